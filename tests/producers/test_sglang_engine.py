"""SGLangEngine's wire format, against a real HTTP server on loopback that records every request and answers
the way SGLang 0.5.10.post1 does (``python/sglang/srt/entrypoints/http_server.py``, ``managers/io_struct.py``,
``managers/tokenizer_manager.py``; see :mod:`producers.sglang_engine`). SGLang itself needs a GPU: the last
test runs the real server where one is present."""
import base64
import io
import json
import logging
import pickle
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from astraflow.config import ConfigError, RunConfig, load_config
from producers.engines import EngineUpdateError, GenerationInterrupted, SamplingParams
from producers.hf_engine import HFEngine
from producers.ports import free_port
from producers.sglang_engine import (SGLangEngine, SGLangHTTPError, launch_command, launch_env,
                                     serialize_named_tensors)

torch.set_num_threads(2)

#: module prefixes SGLang's SafeUnpickler resolves (utils/common.py, 0.5.10.post1), the ones a tensor payload may use
SAFE_PREFIXES = ("builtins.", "collections.", "copyreg.", "functools.", "itertools.", "operator.", "types.",
                 "weakref.", "torch.", "multiprocessing.resource_sharer.", "multiprocessing.reduction.")


class SafeUnpickler(pickle.Unpickler):
    """Resolves only the globals SGLang's ``SafeUnpickler`` allows."""

    def find_class(self, module, name):
        if not any((module + ".").startswith(p) for p in SAFE_PREFIXES):
            raise pickle.UnpicklingError(f"SGLang would refuse {module}.{name}")
        return super().find_class(module, name)


def decode_entry(entry: str) -> list:
    """``MultiprocessingSerializer.deserialize`` of one ``serialized_named_tensors`` entry."""
    return SafeUnpickler(io.BytesIO(base64.b64decode(entry, validate=True))).load()


class FakeSGLang:
    """A threaded HTTP server answering like SGLang. ``routes[(method, path)](body) -> (status, json)``;
    every request is recorded in ``requests`` as ``(method, path, body)`` (body: the parsed JSON or None)."""

    def __init__(self):
        self.requests: list[tuple[str, str, object]] = []
        self.loaded: dict[str, torch.Tensor] = {}  # what /update_weights_from_tensor received, decoded
        ok = {"message": "Generation paused successfully.", "status": "ok"}
        self.routes = {
            ("GET", "/health"): lambda body: (200, None),
            ("GET", "/server_info"): lambda body: (200, {"tp_size": 1, "version": "0.5.10.post1"}),
            ("POST", "/pause_generation"): lambda body: (200, ok),
            ("POST", "/continue_generation"):
                lambda body: (200, {**ok, "message": "Generation continued successfully."}),
            ("POST", "/update_weights_from_tensor"): self.update_from_tensor,
        }
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def answer(self, method):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                fake.requests.append((method, self.path, body))
                route = fake.routes.get((method, self.path))
                status, out = route(body) if route else (404, {"detail": "Not Found"})
                data = b"" if out is None else json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.answer("GET")

            def do_POST(self):
                self.answer("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def update_from_tensor(self, body):
        for name, tensor in decode_entry(body["serialized_named_tensors"][0]):
            self.loaded[name] = tensor
        return 200, {"success": True, "message": "Success"}

    def calls(self):
        """The recorded requests as ``"METHOD /path"`` strings, health checks left out."""
        return [f"{m} {p}" for m, p, _ in self.requests if p != "/health"]

    def bodies(self, path):
        return [b for _, p, b in self.requests if p == path]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    server = FakeSGLang()
    yield server
    server.close()


@pytest.fixture
def engine(fake, tiny_model_dir):
    eng = SGLangEngine(tiny_model_dir, url=fake.url, startup_timeout_s=10, backoff_s=0.01, attempts=2)
    yield eng
    eng.close()


def answer(ids, logprobs, reason):
    """One element of SGLang's /generate answer (tokenizer_manager.py: _handle_batch_output)."""
    return {"text": "", "output_ids": ids,
            "meta_info": {"id": "r", "finish_reason": reason, "prompt_tokens": 3, "weight_version": "default",
                          "total_retractions": 0,
                          "output_token_logprobs": [[lp, t, None] for t, lp in zip(ids, logprobs)],
                          "completion_tokens": len(ids), "cached_tokens": 0}}


def test_generate_returns_sglang_answers_as_generations(fake, engine):
    eos = engine.tokenizer.eos_token_id
    fake.routes[("POST", "/generate")] = lambda body: (200, [
        answer([5, 6, eos], [-0.5, -1.25, -0.125], {"type": "stop", "matched": eos}),
        answer([7, 8, 9, 10], [-2.0, -0.25, -3.5, -0.75], {"type": "length", "length": 4}),
    ])
    gens = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=4, temperature=0.7))
    assert [g.output_ids.tolist() for g in gens] == [[5, 6, eos], [7, 8, 9, 10]]
    assert [g.output_ids.dtype for g in gens] == [np.int32, np.int32]
    np.testing.assert_array_equal(gens[0].logprobs, np.array([-0.5, -1.25, -0.125], dtype=np.float32))
    np.testing.assert_array_equal(gens[1].logprobs, np.array([-2.0, -0.25, -3.5, -0.75], dtype=np.float32))
    assert [g.logprobs.dtype for g in gens] == [np.float32, np.float32]
    assert [g.finish_reason for g in gens] == ["stop", "length"]
    assert [g.version for g in gens] == [0, 0]
    # an aborted request, or output ids that disagree with the logprobs, is an error, not a generation
    fake.routes[("POST", "/generate")] = lambda body: (200, [answer([5], [-0.1], {"type": "abort", "message": "gone"})])
    with pytest.raises(RuntimeError, match="aborted prompt 0 of the batch: gone"):
        engine.generate([[1]], SamplingParams())
    bad = answer([5, 6], [-0.1, -0.2], {"type": "length", "length": 2})
    bad["output_ids"] = [5, 7]
    fake.routes[("POST", "/generate")] = lambda body: (200, [bad])
    with pytest.raises(RuntimeError, match="differ from its logprobs' token ids"):
        engine.generate([[1]], SamplingParams())


def test_stop_ids_are_sent_and_ignore_eos_stays_false(fake, engine):
    fake.routes[("POST", "/generate")] = lambda body: (200, [answer([3], [-0.1], {"type": "stop", "matched": 3})])
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5, temperature=0.5, stop_token_ids=(3, 9)))
    body = fake.bodies("/generate")[-1]
    assert len(body.pop("rid")) == 1  # request ids, so that an interrupt can abort them
    assert body == {
        "input_ids": [[1, 2, 3]],
        "sampling_params": {"max_new_tokens": 5, "temperature": 0.5, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                            "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                            "min_new_tokens": 0, "stop_token_ids": [3, 9], "ignore_eos": False,
                            "skip_special_tokens": False},
        "return_logprob": True, "logprob_start_len": -1}
    engine.generate([[1]], SamplingParams())  # None: the tokenizer's EOS
    params = fake.bodies("/generate")[-1]["sampling_params"]
    assert (params["stop_token_ids"], params["ignore_eos"]) == ([engine.tokenizer.eos_token_id], False)
    engine.generate([[1]], SamplingParams(stop_token_ids=()))  # no stop token at all: only then ignore_eos
    params = fake.bodies("/generate")[-1]["sampling_params"]
    assert (params["stop_token_ids"], params["ignore_eos"]) == ([], True)
    engine.generate([[1]], SamplingParams(stop=("</tool_call>",)))  # stop strings go as SGLang's `stop`
    assert fake.bodies("/generate")[-1]["sampling_params"]["stop"] == ["</tool_call>"]


def test_top_p_below_one_is_sent_as_is_and_logprobs_are_the_servers(fake, engine):
    """SGLang's logprobs are log_softmax(logits / T) before top-p truncation (layers/sampler.py), the trainer's
    recompute: top_p < 1 is accepted, sent unchanged with top-k and min-p off, and the logprobs pass through."""
    reply = [answer([4, 2], [-0.3, -4.0], {"type": "length", "length": 2})]
    fake.routes[("POST", "/generate")] = lambda body: (200, reply)
    gens = engine.generate([[1, 2]], SamplingParams(max_new_tokens=2, temperature=0.8, top_p=0.9))
    params = fake.bodies("/generate")[-1]["sampling_params"]
    assert (params["top_p"], params["temperature"], params["top_k"], params["min_p"]) == (0.9, 0.8, -1, 0.0)
    assert "sampling_seed" not in params
    np.testing.assert_array_equal(gens[0].logprobs, np.array([-0.3, -4.0], dtype=np.float32))
    # a launched server takes logprobs at the sampling temperature, not the original distribution
    assert launch_env({"PATH": "/bin"}) == {"PATH": "/bin", "SGLANG_RETURN_ORIGINAL_LOGPROB": "false"}


def test_http_errors_name_the_endpoint_status_and_body(fake, engine):
    message = {"error": {"message": "The input (300 tokens) is longer than the model's context length (256 tokens)."}}
    fake.routes[("POST", "/generate")] = lambda body: (400, message)
    with pytest.raises(SGLangHTTPError, match=r"POST /generate at http://127\.0\.0\.1:\d+ answered HTTP 400: "
                                              r".*longer than the model's context length") as info:
        engine.generate([[1]], SamplingParams())
    assert (info.value.status, info.value.path) == (400, "/generate")
    assert len(fake.bodies("/generate")) == 1  # a 4xx is not retried
    fake.routes[("POST", "/generate")] = lambda body: (503, {"detail": "busy"})
    with pytest.raises(SGLangHTTPError, match="answered HTTP 503"):
        engine.generate([[1]], SamplingParams())
    assert len(fake.bodies("/generate")) == 1 + engine.attempts  # a 5xx is retried


def test_update_sends_only_changed_tensors_between_pause_and_continue(fake, engine):
    state = {k: torch.randn(shape) for k, shape in engine.param_shapes().items()}
    engine.load_weights(state, 1)
    assert engine.version == 1
    assert fake.calls() == ["GET /server_info", "POST /pause_generation", "POST /update_weights_from_tensor",
                            "POST /continue_generation"]
    assert fake.bodies("/pause_generation") == [{"mode": "abort"}]
    assert fake.bodies("/continue_generation") == [{}]
    first = fake.bodies("/update_weights_from_tensor")[0]
    assert {k: v for k, v in first.items() if k != "serialized_named_tensors"} == {
        "load_format": None, "flush_cache": True, "abort_all_requests": False, "weight_version": "1"}
    assert len(first["serialized_named_tensors"]) == 1  # tp_size 1: one entry
    assert sorted(fake.loaded) == sorted(state)  # the first update sends everything: the server's weights are unknown
    assert all(torch.equal(fake.loaded[k], state[k]) for k in state)

    fake.requests.clear()
    fake.loaded.clear()
    name = "model.layers.0.mlp.down_proj.weight"
    state[name] = state[name] + 1.0
    engine.load_weights(state, 2)
    assert engine.version == 2
    assert fake.calls() == ["POST /pause_generation", "POST /update_weights_from_tensor", "POST /continue_generation"]
    body = fake.bodies("/update_weights_from_tensor")[0]
    assert [n for n, _ in decode_entry(body["serialized_named_tensors"][0])] == [name]
    assert torch.equal(fake.loaded[name], state[name])
    assert (body["flush_cache"], body["weight_version"]) == (True, "2")

    fake.requests.clear()
    engine.load_weights(state, 3)  # nothing changed: no request, the version still moves
    assert (fake.calls(), engine.version) == ([], 3)


def test_large_updates_go_in_buckets_and_flush_only_at_the_end(fake, engine):
    state = {k: torch.randn(shape) for k, shape in engine.param_shapes().items()}
    engine.bucket_bytes = 128 * 128 * 4  # one q_proj weight
    fake.routes[("GET", "/server_info")] = lambda body: (200, {"tp_size": 2})
    engine.load_weights(state, 1)
    bodies = fake.bodies("/update_weights_from_tensor")
    assert len(bodies) > 3
    calls = fake.calls()
    assert calls[1] == "POST /pause_generation" and calls[-1] == "POST /continue_generation"
    assert [b["flush_cache"] for b in bodies] == [False] * (len(bodies) - 1) + [True]
    assert [b["weight_version"] for b in bodies] == [None] * (len(bodies) - 1) + ["1"]
    for b in bodies:  # one entry per TP rank (tp_worker.py reads serialized_named_tensors[tp_rank])
        assert len(b["serialized_named_tensors"]) == 2
        assert b["serialized_named_tensors"][0] == b["serialized_named_tensors"][1]
    assert sorted(fake.loaded) == sorted(state)


def test_failed_update_is_an_error_and_keeps_the_old_version(fake, engine):
    state = {k: torch.randn(shape) for k, shape in engine.param_shapes().items()}
    engine.load_weights(state, 1)
    fake.requests.clear()
    refusal = {"success": False, "message": "Failed to update weights: out of memory."}
    fake.routes[("POST", "/update_weights_from_tensor")] = lambda body: (400, refusal)
    name = "model.norm.weight"
    state[name] = state[name] * 2
    with pytest.raises(EngineUpdateError) as info:
        engine.load_weights(state, 2)
    message = str(info.value)
    assert "version 2 not loaded" in message and "POST /update_weights_from_tensor" in message
    assert "HTTP 400" in message and "out of memory" in message
    assert "stays at version 1" in message and "still holds version 1" in message
    assert engine.version == 1
    assert fake.calls()[-1] == "POST /continue_generation"  # generation resumes after a failure too

    # names and shapes are checked before anything is sent
    fake.requests.clear()
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        engine.load_weights({"nope": torch.zeros(1)}, 2)
    with pytest.raises(ValueError, match="has shape"):
        engine.load_weights({name: torch.zeros(3)}, 2)
    assert fake.calls() == [] and engine.version == 1

    # the server answers again: the tensor of the failed update is sent again, and only it
    fake.routes[("POST", "/update_weights_from_tensor")] = fake.update_from_tensor
    fake.loaded.clear()
    engine.load_weights(state, 2)
    assert (sorted(fake.loaded), engine.version) == ([name], 2)


def test_a_failed_resume_neither_hides_the_update_error_nor_leaves_the_server_paused(fake, engine):
    state = {k: torch.randn(shape) for k, shape in engine.param_shapes().items()}
    fake.routes[("POST", "/update_weights_from_tensor")] = lambda body: (400, {"success": False, "message": "oom"})
    fake.routes[("POST", "/continue_generation")] = lambda body: (400, {"error": {"message": "scheduler busy"}})
    with pytest.raises(EngineUpdateError) as info:
        engine.load_weights(state, 1)
    message = str(info.value)
    assert "version 1 not loaded" in message and "oom" in message  # the update's own error comes first
    assert "could not be resumed" in message and "scheduler busy" in message
    # the next call resumes the server before anything else, and fails as long as it cannot
    fake.requests.clear()
    fake.routes[("POST", "/generate")] = lambda body: (200, [answer([3], [-0.1], {"type": "stop", "matched": 3})])
    with pytest.raises(SGLangHTTPError, match="continue_generation"):
        engine.generate([[1]], SamplingParams())
    assert fake.calls() == ["POST /continue_generation"]
    fake.routes[("POST", "/continue_generation")] = lambda body: (200, {"message": "Generation continued."})
    fake.requests.clear()
    engine.generate([[1]], SamplingParams())
    assert fake.calls() == ["POST /continue_generation", "POST /generate"]
    engine.generate([[1]], SamplingParams())  # resumed once: not again
    assert fake.calls()[-1] == "POST /generate" and fake.calls().count("POST /continue_generation") == 1


def test_in_place_pause_keeps_requests_needs_no_radix_cache_and_flushes_nothing(fake, tiny_model_dir):
    eng = SGLangEngine(tiny_model_dir, url=fake.url, startup_timeout_s=10, pause_mode="in_place")
    state = {k: torch.randn(shape) for k, shape in eng.param_shapes().items()}
    with pytest.raises(EngineUpdateError, match="--disable-radix-cache"):  # the default server keeps one
        eng.load_weights(state, 1)
    assert "POST /pause_generation" not in fake.calls() and eng.version == 0
    fake.routes[("GET", "/server_info")] = lambda body: (200, {"tp_size": 1, "disable_radix_cache": True})
    eng.load_weights(state, 1)
    assert fake.bodies("/pause_generation")[-1] == {"mode": "in_place"}
    assert not any(b["flush_cache"] for b in fake.bodies("/update_weights_from_tensor"))
    assert fake.calls()[-1] == "POST /continue_generation" and eng.version == 1
    with pytest.raises(ValueError, match="pause_mode 'retract'"):
        SGLangEngine(tiny_model_dir, url=fake.url, startup_timeout_s=10, pause_mode="retract")
    eng.close()


def test_an_interrupt_aborts_the_running_request_on_the_server(fake, engine):
    import threading as th

    release = th.Event()

    def slow(body):  # a long generation: it answers only once released
        release.wait(30)
        return 200, [answer([3], [-0.1], {"type": "abort", "message": "aborted"})]

    fake.routes[("POST", "/generate")] = slow
    fake.routes[("POST", "/abort_request")] = lambda body: (release.set(), (200, None))[1]
    engine.interrupt = th.Event()
    th.Timer(0.5, engine.interrupt.set).start()
    t0 = time.monotonic()
    with pytest.raises(GenerationInterrupted, match="aborted"):
        engine.generate([[1, 2], [3]], SamplingParams())
    # ended by the abort, ~0.5 s in, not by the 30 s the generation holds it otherwise (15 s: a busy machine's slack)
    assert time.monotonic() - t0 < 15
    rids = fake.bodies("/generate")[-1]["rid"]
    prefix = fake.bodies("/abort_request")[-1]["rid"]
    assert len(rids) == 2 and all(r.startswith(prefix) for r in rids)  # the server aborts by prefix
    with pytest.raises(GenerationInterrupted, match="before the request was sent"):
        engine.generate([[1]], SamplingParams())


def test_the_worker_keeps_its_version_when_the_engine_refuses_and_retries_later(tmp_path, caplog):
    """RaasWorker.sync_weights with a real Puller and store: the puller's copy moves on (in its pull thread)
    before the engine loads it, so a refused load is handed to the engine again at the next sync instead of
    leaving it behind for good. The refusal is one warning; the load that then succeeds says after how many."""
    import concurrent.futures

    from producers.engine_batcher import EngineBatcher
    from producers.engine_sync import EngineSync
    from producers.engines import Engine
    from producers.raas import RaasWorker
    from topics.names import TopicNames
    from weights.publisher import Publisher
    from weights.puller import Puller
    from weights.store import WeightStore

    class Flaky(Engine):
        def __init__(self):
            self._version, self.refuse = 0, 1

        def generate(self, batch, sampling):
            raise NotImplementedError

        def load_weights(self, state_dict, version):
            if self.refuse:
                self.refuse -= 1
                raise EngineUpdateError(f"version {version} not loaded: the server is busy")
            self._version = version

    run, names = "flaky", TopicNames("flaky")
    store = WeightStore((tmp_path / "weights").as_uri(), run)
    pub = Publisher(store, None, names, "actor")
    pub.publish({"w": torch.ones(4)}, 1)
    pub.close()
    assert not pub.errors
    engine = Flaky()
    puller = Puller(store, None, names, "actor")  # no bus: the newest version is the store listing's
    batcher = EngineBatcher(engine)
    worker = SimpleNamespace(id="raas-0", syncs={"actor": EngineSync(engine, puller)}, _pulls={},
                             _pull_errors={}, batchers={"actor": batcher}, _loads={}, _sync_failures={})
    worker._fetch = lambda policy, version: RaasWorker._fetch(worker, policy, version)
    worker._sync_failed = lambda policy, error: RaasWorker._sync_failed(worker, policy, error)
    caplog.set_level(logging.INFO, logger="producers.raas")
    RaasWorker.sync_weights(worker)  # starts the pull
    worker._pulls["actor"].join(30)
    RaasWorker.sync_weights(worker)  # hands the copy to the engine, on the engine's thread
    concurrent.futures.wait([worker._loads["actor"][0]], 30)
    assert (engine.version, puller.version) == (0, 1)  # refused: the engine kept its version (before the retry,
    # which the engine's thread may finish at once)
    RaasWorker.sync_weights(worker)  # the refusal logged, not raised, and the copy handed again
    concurrent.futures.wait([worker._loads["actor"][0]], 30)
    RaasWorker.sync_weights(worker)
    assert engine.version == 1
    batcher.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("raas-0: keeping version 0 of actor"), warnings
    assert "raas-0: policy actor now at version 1 (after 1 failed attempt(s))" in caplog.messages


FAKE_LAUNCHER = r'''
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
with open(os.path.join(os.environ["FAKE_SGLANG_DIR"], f"{port}.json"), "w") as f:
    json.dump({"argv": args, "SGLANG_RETURN_ORIGINAL_LOGPROB": os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB")}, f)
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
HTTPServer((host, port), H).serve_forever()
'''


def test_launched_engines_get_their_own_ports(tiny_model_dir, tmp_path, monkeypatch):
    script = tmp_path / "fake_launch_server.py"
    script.write_text(FAKE_LAUNCHER)
    monkeypatch.setenv("FAKE_SGLANG_DIR", str(tmp_path))
    launcher = (sys.executable, str(script))
    engines = []
    try:
        engines.append(SGLangEngine(tiny_model_dir, launcher=launcher, startup_timeout_s=60,
                                    launch_args=("--tp-size", "1")))
        engines.append(SGLangEngine(tiny_model_dir, launcher=launcher, startup_timeout_s=60))
        fixed = free_port()
        engines.append(SGLangEngine(tiny_model_dir, port=fixed, launcher=launcher, startup_timeout_s=60))
        ports = [int(e.url.rsplit(":", 1)[1]) for e in engines]
        assert len(set(ports)) == 3 and ports[2] == fixed
        for e, port in zip(engines, ports):
            seen = json.loads((tmp_path / f"{port}.json").read_text())
            assert seen["argv"] == e.argv[2:]  # what the server process was started with
            assert seen["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "false"
        assert engines[0].argv[2:] == ["--model-path", str(tiny_model_dir), "--host", "127.0.0.1", "--port",
                                       str(ports[0]), "--weight-version", "0", "--tp-size", "1"]
    finally:
        procs = [e._proc for e in engines]
        for e in engines:
            e.close()
    assert all(p.poll() is not None for p in procs)  # close() stops the launched servers


def test_launch_command_and_a_server_that_dies_at_startup(tiny_model_dir, tmp_path):
    assert launch_command("/m", "0.0.0.0", 31000, ("--mem-fraction-static", "0.5"), version=3, launcher=("sgl",)) == [
        "sgl", "--model-path", "/m", "--host", "0.0.0.0", "--port", "31000", "--weight-version", "3",
        "--mem-fraction-static", "0.5"]
    with pytest.raises(ValueError, match=r"\['--port=1'\].*sets --model-path, --host, --port"):
        launch_command("/m", "127.0.0.1", 1, ("--port=1",))
    dying = (sys.executable, "-c", "import sys; sys.exit(3)")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code 3 before answering"):
        SGLangEngine(tiny_model_dir, launcher=dying, startup_timeout_s=60)
    assert time.monotonic() - t0 < 30  # told at its exit (~0.1-1 s), not after the 60 s start-up timeout


def test_config_sglang_section_reaches_the_engine(tmp_path, monkeypatch):
    import producers.raas as raas
    import producers.sglang_engine as sglang_engine

    def config(**sglang):
        return {"policies": {"actor": {"model": "tiny", "engine": "sglang", "sglang": sglang}}}

    cfg = RunConfig.model_validate(config(port=31000, launch_args=["--mem-fraction-static", "0.5"],
                                          startup_timeout_s=30, timeout_s=90, bucket_bytes=1 << 20, attempts=3,
                                          pause_mode="in_place"))
    seen = {}
    monkeypatch.setattr(sglang_engine, "SGLangEngine", lambda *a, **kw: seen.update(args=a, kwargs=kw))
    monkeypatch.setattr(raas, "resolve_model", lambda spec: Path("/models/tiny"))
    raas.make_engine("actor", cfg.policies["actor"])
    assert seen == {"args": (Path("/models/tiny"),), "kwargs": {
        "url": None, "port": 31000, "launch_args": ("--mem-fraction-static", "0.5"), "startup_timeout_s": 30.0,
        "timeout_s": 90.0, "bucket_bytes": 1 << 20, "attempts": 3, "pause_mode": "in_place"}}
    attach = RunConfig.model_validate(config(url="http://gpu-7:30000")).policies["actor"].sglang
    assert (attach.url, attach.port, attach.launch_args) == ("http://gpu-7:30000", None, [])

    for bad, message in [(config(url="http://h:1", port=2), "sglang.url attaches to a running server"),
                         (config(launch_args=["--port", "5"]), "the engine sets --model-path, --host, --port"),
                         (config(pause_mode="retract"), "pause_mode"),
                         ({"policies": {"actor": {"model": "tiny", "sglang": {"port": 1}}}},
                          "sglang settings apply to engine: sglang"),
                         ({"policies": {"actor": {"model": "tiny", "engine": "sglang", "sglang_url": "http://h:1"}}},
                          "sglang_url")]:
        path = tmp_path / "c.yaml"
        path.write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=message):
            load_config(path)


def test_serialized_tensors_use_only_what_sglang_unpickles():
    tied = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    big = torch.arange(100, dtype=torch.float32)
    entry = serialize_named_tensors([("a", tied), ("b", tied), ("view", big[10:14]),
                                     ("p", torch.nn.Parameter(big[:2]))])
    out = decode_entry(entry)
    assert [n for n, _ in out] == ["a", "b", "view", "p"]
    assert out[0][1].dtype == torch.bfloat16 and torch.equal(out[0][1], tied)
    assert torch.equal(out[2][1], big[10:14]) and out[2][1].untyped_storage().nbytes() == 16  # not the whole storage
    assert type(out[3][1]) is torch.Tensor and not out[3][1].requires_grad


@pytest.mark.gpu
def test_sglang_logprobs_match_the_trainer_and_follow_weight_updates(tiny_model_dir):
    """The real server (launched on a free port): behaviour logprobs equal log_softmax(logits / T) of the
    reference model, also with top_p < 1, and an in-place update changes them."""
    pytest.importorskip("sglang")
    eng = SGLangEngine(tiny_model_dir, launch_args=("--mem-fraction-static", "0.2", "--dtype", "float32"))
    try:
        ref = HFEngine(tiny_model_dir, dtype=torch.float32)
        batch = [ref.tokenizer.encode(p) for p in ["3+4=", "12+9=", "7+15="]]

        def logprob_error(top_p: float = 1.0) -> float:
            """Mean |server logprob - reference logprob| of 8 sampled tokens per prompt, at T=0.7."""
            gens = eng.generate(batch, SamplingParams(max_new_tokens=8, temperature=0.7, top_p=top_p,
                                                      stop_token_ids=()))
            diffs = []
            with torch.inference_mode():
                for prompt, g in zip(batch, gens):
                    assert len(g.output_ids) == 8
                    ids = torch.tensor([prompt + g.output_ids.tolist()])
                    logits = ref.model(ids).logits[0, len(prompt) - 1:-1].float()
                    lp = torch.log_softmax(logits / 0.7, -1).gather(1, ids[0, len(prompt):, None])[:, 0]
                    diffs.append(np.abs(lp.numpy() - g.logprobs))
            return float(np.concatenate(diffs).mean())

        assert logprob_error() < 1e-2
        assert logprob_error(top_p=0.8) < 1e-2
        # new weights (the embedding, tied to the output layer, tripled: a different distribution), sent in place
        state = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}
        state["model.embed_tokens.weight"] *= 3.0
        if "lm_head.weight" in state:  # tied: SGLang loads the head from the embedding (models/qwen2.py)
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        eng.load_weights(state, version=1)
        assert eng.version == 1
        assert logprob_error() > 0.1  # the reference still holds the old weights
        ref.model.load_state_dict(state)
        assert logprob_error() < 1e-2
    finally:
        eng.close()

"""The vLLM engine on a real vLLM CPU server (``.venv-vllm``, scripts/install_vllm.sh) serving the tiny model:
behaviour logprobs equal the trainer's recompute on the same weights, and a weight update, pulled by the
server itself from the store (a full snapshot, then a sparse delta), changes what it generates while parity
holds; a wrong checksum is refused with the old weights kept."""
import socket
import threading
import time
import uuid
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from producers.engines import EngineUpdateError, GenerationInterrupted, SamplingParams
from producers.hf_engine import HFEngine
from producers.vllm_engine import VLLMEngine
from producers import vllm_server
from producers.vllm_server import VLLMServer, server_argv
from producers.workflows import prompt_ids
from topics.bus import connect
from topics.layout import ensure_run_topics
from topics.names import TopicNames
from trainer.model import load_causal_lm, token_logprobs
from weights.publisher import Publisher
from weights.store import WeightStore

PROMPTS = ["3+4=", "12+9=", "7+15=", "1+1="]
SAMPLING = SamplingParams(max_new_tokens=6, temperature=0.6, seed=0)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """The module's server. Its first start gets a port another socket holds, as when another process takes the
    port a server chose before the server binds it (seen in CI): it must come up on another port."""
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    real_free_port = vllm_server.free_port
    with socket.socket() as taken, pytest.MonkeyPatch.context() as mp:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        held = taken.getsockname()[1]
        ports = iter([held])
        mp.setattr(vllm_server, "free_port", lambda: next(ports, None) or real_free_port())
        s = VLLMServer(tiny_model_dir, log, dtype="float32", max_model_len=256)
        try:
            s.wait_healthy(600)
        except BaseException:
            s.stop()
            raise
    assert s.port != held and f"port {held} was taken before the server bound it" in log.read_text()
    with s:
        yield s


def descendants(pid: int) -> list[str]:
    """The command lines of every live process below ``pid`` (read from /proc)."""
    parent, cmdline = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError):
            continue  # gone meanwhile
        parent[int(stat.parent.name)] = int(fields[1])
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        todo += kids
    return [cmdline[c][:120] for c in found]


def recompute(model, batch, gens, temperature):
    """The trainer's teacher-forced logprobs of each generated token (trainer.model.token_logprobs)."""
    out = []
    with torch.no_grad():
        for prompt, g in zip(batch, gens):
            ids = torch.tensor([prompt + g.output_ids.tolist()])
            logp, _ = token_logprobs(model, ids, torch.ones_like(ids), temperature)
            out.append(logp[0, len(prompt):])
    return out


def max_gap(model, batch, gens, temperature=SAMPLING.temperature) -> float:
    return max(float((torch.from_numpy(g.logprobs) - r).abs().max())
               for g, r in zip(gens, recompute(model, batch, gens, temperature)))


def perturbed(state, names, scale, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: (v + scale * v.std() * torch.randn(v.shape, generator=g) if k in names else v.clone())
            for k, v in state.items()}


@pytest.mark.slow
def test_vllm_logprobs_match_the_trainer_and_updates_change_the_policy(server, tiny_model_dir, tmp_path):
    engine = VLLMEngine(server.url, tiny_model_dir, startup_timeout_s=60)
    batch = [prompt_ids(engine.tokenizer, p) for p in PROMPTS] * 4
    model = load_causal_lm(tiny_model_dir, "float32")
    before = engine.generate(batch, SAMPLING)
    assert len(before) == len(batch) and all(len(g.output_ids) >= 1 for g in before)
    assert max_gap(model, batch, before) < 1e-5
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    greedy_before = engine.generate(batch[:4], greedy)
    assert max_gap(model, batch[:4], greedy_before, temperature=1.0) < 1e-5

    # version 1: every tensor perturbed (a full snapshot); version 2: one attention projection only (a delta)
    run, store_uri = f"vllm{uuid.uuid4().hex[:8]}", (tmp_path / "store").as_uri()
    bus = connect(f"local://{tmp_path / 'bus'}")
    names = TopicNames(run)
    bus.admin().create_topic(names.weights, partitions=1, compacted=True)
    publisher = Publisher(WeightStore(store_uri, run), bus, names, "actor")
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    v1 = perturbed(base, set(base), 0.5, seed=1)
    v2 = perturbed(v1, {"model.layers.0.self_attn.k_proj.weight"}, 2.0, seed=2)
    shas = {}
    for version, state in ((1, v1), (2, v2)):
        publisher.publish(state, version)
        assert publisher.wait(60)
        shas[version] = publisher.announcements[-1].sha256
    publisher.close()
    assert WeightStore(store_uri, run).versions("actor")[2].get("delta") is not None, "version 2 should be a delta"

    for version, state in ((1, v1), (2, v2)):
        engine.pull(store_uri, run, "actor", version, shas[version])
        assert engine.version == version
        model.load_state_dict(state)
        after = engine.generate(batch[:4], greedy)
        assert max_gap(model, batch[:4], after, temperature=1.0) < 1e-5, f"parity after version {version}"
        sampled = engine.generate(batch, SAMPLING)
        assert max_gap(model, batch, sampled) < 1e-5
    changed = [(a.output_ids.tolist(), a.logprobs.tolist()) != (b.output_ids.tolist(), b.logprobs.tolist())
               for a, b in zip(greedy_before, after)]
    assert all(changed), "an update left vLLM's greedy continuations unchanged"

    with pytest.raises(EngineUpdateError, match="version 2"):
        engine.pull(store_uri, run, "actor", 2, "0" * 64)
    assert engine.version == 2
    assert max_gap(model, batch[:4], engine.generate(batch[:4], greedy), temperature=1.0) < 1e-5
    engine.close()


def test_hf_engine_logprobs_match_the_trainer_after_an_update(tiny_model_dir):
    engine = HFEngine(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir, "float32")
    batch = [prompt_ids(engine.tokenizer, p) for p in PROMPTS] * 4
    state = perturbed({k: v.detach().clone() for k, v in model.state_dict().items()}, set(model.state_dict()),
                      0.5, seed=3)
    engine.load_weights(state, 1)
    model.load_state_dict(state)
    assert max_gap(model, batch, engine.generate(batch, SAMPLING)) < 1e-5


@pytest.mark.slow
def test_a_server_is_two_processes_its_worker_in_the_engine_core(server):
    """The running server: the API server and one engine-core child (and multiprocessing's resource tracker), no
    third process for the worker (vLLM's CPU platform would add one for a ``uni`` executor unless
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    children = [c for c in descendants(server.proc.pid) if "multiprocessing.resource_tracker" not in c]
    assert len(children) == 1 and children[0].startswith("VLLM::EngineCore"), children
    assert "multiproc_executor" not in server.log_path.read_text(errors="replace")


def test_one_worker_runs_in_the_engine_core_unless_the_args_ask_for_parallelism():
    """``server_argv`` adds ``--distributed-executor-backend uni`` (no third process importing vLLM) only when
    ``vllm.args`` neither asks for tensor/pipeline/data parallelism nor picks an executor itself."""
    plain = server_argv("py", "m", 8000)
    assert plain[plain.index("--distributed-executor-backend") + 1] == "uni"
    for extra in (["--tensor-parallel-size", "2"], ["-tp=2"], ["--distributed-executor-backend", "mp"]):
        argv = server_argv("py", "m", 8000, extra=extra)
        assert argv.count("--distributed-executor-backend") == extra.count("--distributed-executor-backend")
        assert argv[-len(extra):] == extra


def test_a_request_that_fails_as_the_worker_stops_is_an_interruption_not_an_error(tiny_model_dir):
    """At the end of a run the server may go while a request is in flight: once the engine's interrupt is set,
    that failure is the stop (GenerationInterrupted, the batch left for redelivery), not a crash of RaaS; the
    same failure before a stop stays a RuntimeError. The server here is healthy and then drops the completion
    request's connection, as a stopping vLLM server does."""
    stopping = threading.Event()

    class DyingServer(BaseHTTPRequestHandler):
        stops_the_worker = False  # the worker's stop is set while the request is in flight

        def do_GET(self):  # /health
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            if DyingServer.stops_the_worker:
                stopping.set()
            self.close_connection = True  # no answer: the connection just closes

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), DyingServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        engine = VLLMEngine(f"http://127.0.0.1:{httpd.server_port}", tiny_model_dir, startup_timeout_s=10)
        batch = [prompt_ids(engine.tokenizer, "1+1=")]
        with pytest.raises(RuntimeError, match="/v1/completions") as failed:
            engine.generate(batch, SAMPLING)
        assert failed.type is RuntimeError
        engine.interrupt = stopping
        DyingServer.stops_the_worker = True
        with pytest.raises(GenerationInterrupted, match="while stopping"):
            engine.generate(batch, SAMPLING)
    finally:
        httpd.shutdown()


@pytest.mark.slow
def test_eval_and_live_eval_update_a_vllm_engine_through_the_one_sync_contract(server, tiny_model_dir, tmp_path):
    """Offline eval (:func:`consumers.evaluation.pull_newest`: the store listing decides, no announcement, so no
    checksum to hold the server to) and live eval (:class:`consumers.evaluation.LiveEvaluator`: the announced
    checksum) both bring a vLLM engine to the newest version through EngineSync, the server pulling it itself;
    before EngineSync they called ``load_weights``, which a vLLM engine refuses."""
    from consumers.evaluation import LiveEvaluator, load_benchmark, pull_newest

    run, store_uri = f"veval{uuid.uuid4().hex[:8]}", (tmp_path / "store").as_uri()
    bus = connect(f"local://{tmp_path / 'bus'}")
    names = TopicNames(run)
    ensure_run_topics(bus.admin(), names, ["actor"])
    publisher = Publisher(WeightStore(store_uri, run), bus, names, "actor")
    base = {k: v.detach().clone() for k, v in load_causal_lm(tiny_model_dir, "float32").state_dict().items()}
    states = {1: perturbed(base, set(base), 0.5, seed=4)}
    states[2] = perturbed(states[1], {"model.layers.0.mlp.up_proj.weight"}, 2.0, seed=5)
    states[3] = perturbed(states[2], {"model.layers.1.self_attn.q_proj.weight"}, 2.0, seed=6)
    for version in (1, 2):
        publisher.publish(states[version], version)
        assert publisher.wait(60)

    offline = VLLMEngine(server.url, tiny_model_dir, startup_timeout_s=60)
    assert pull_newest(offline, store_uri, run, "actor") == 2
    model = load_causal_lm(tiny_model_dir, "float32")
    model.load_state_dict(states[2])
    batch = [prompt_ids(offline.tokenizer, p) for p in PROMPTS]
    assert max_gap(model, batch, offline.generate(batch, SAMPLING)) < 1e-5
    offline.close()

    live = VLLMEngine(server.url, tiny_model_dir, startup_timeout_s=60)
    evaluator = LiveEvaluator(bus, store_uri, run, "actor", live, load_benchmark("arith", 4), k=1, max_new_tokens=4)
    assert evaluator.step(poll_s=5.0).version == 2
    publisher.publish(states[3], 3)
    assert publisher.wait(60)
    publisher.close()
    deadline = time.monotonic() + 60
    while live.version < 3 and time.monotonic() < deadline:
        evaluator.step(poll_s=1.0)
    assert live.version == 3 and evaluator.evaluated == {2, 3}
    model.load_state_dict(states[3])
    assert max_gap(model, batch, live.generate(batch, SAMPLING)) < 1e-5
    live.close()


@pytest.mark.slow
def test_a_pull_under_live_generations_never_mixes_two_versions_in_one(server, tiny_model_dir, tmp_path):
    """16 generations in flight at once (the engine's concurrent_calls) while the server pulls a new version: each
    generation's logprobs are the trainer's under the one version it is stamped with, so no request ran across
    the swap. Without the engine's SwapGate, the generations in flight at the pull came back stamped with the old
    version and carried tokens sampled under the new one."""
    run, store_uri = f"vswap{uuid.uuid4().hex[:8]}", (tmp_path / "store").as_uri()
    bus = connect(f"local://{tmp_path / 'bus'}")
    names = TopicNames(run)
    bus.admin().create_topic(names.weights, partitions=1, compacted=True)
    publisher = Publisher(WeightStore(store_uri, run), bus, names, "actor")
    base = {k: v.detach().clone() for k, v in load_causal_lm(tiny_model_dir, "float32").state_dict().items()}
    states = {1: perturbed(base, set(base), 0.5, seed=7)}
    states[2] = perturbed(states[1], set(base), 0.5, seed=8)
    shas = {}
    for version in (1, 2):
        publisher.publish(states[version], version)
        assert publisher.wait(60)
        shas[version] = publisher.announcements[-1].sha256
    publisher.close()
    engine = VLLMEngine(server.url, tiny_model_dir, startup_timeout_s=60)
    engine.pull(store_uri, run, "actor", 1, shas[1])
    batch = [prompt_ids(engine.tokenizer, p) for p in PROMPTS]
    long = SamplingParams(max_new_tokens=64, temperature=1.0, stop_token_ids=())  # no stop: every row runs 64 tokens
    results, errors, stop = [], [], threading.Event()

    def generate_until_stopped():
        try:
            while not stop.is_set():
                results.append((batch, engine.generate(batch, long)))
        except Exception as e:  # noqa: BLE001 - the assertion below names it
            errors.append(e)

    threads = [threading.Thread(target=generate_until_stopped) for _ in range(engine.concurrent_calls)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 300
    while len(results) < engine.concurrent_calls:  # every thread's first generation is back: all 16 are in flight
        assert time.monotonic() < deadline and not errors, errors
        time.sleep(0.05)
    engine.pull(store_uri, run, "actor", 2, shas[2])
    seen = len(results)
    while len(results) < seen + engine.concurrent_calls:  # generations sent after the pull
        assert time.monotonic() < deadline and not errors, errors
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(300)
    engine.close()
    assert not errors, errors
    models = {}
    for v in (1, 2):
        models[v] = load_causal_lm(tiny_model_dir, "float32")
        models[v].load_state_dict(states[v])
    by_version = {1: 0, 2: 0}
    for prompts, gens in results:
        for g in gens:
            by_version[g.version] += 1
        version = gens[0].version
        assert {g.version for g in gens} == {version}
        gap = max_gap(models[version], prompts, gens, temperature=1.0)
        assert gap < 1e-4, f"a generation stamped version {version} is off its logprobs by {gap}"
    assert by_version[1] > 0 and by_version[2] > 0, by_version

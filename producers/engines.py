"""Inference engines for rollouts: one interface, a transformers engine and an SGLang client.

An :class:`Engine` turns a batch of prompt token ids into sampled continuations
with their *behaviour logprobs*, and accepts new weights between rollouts.

Logprob convention (shared with the trainer): the behaviour logprob of a
generated token is ``log_softmax(logits / T)[token]``, the log-probability
under the temperature-scaled distribution, where ``T`` is
``SamplingParams.temperature``. The trainer recomputes logprobs with the same
temperature. top-p truncation is *not* reflected (the full temperature-scaled
softmax is used), so with ``top_p < 1`` the recorded value is the probability
before truncation. With ``temperature == 0`` (greedy) logprobs are taken at
``T = 1``. SGLang returns the same quantity by default (its
``SGLANG_RETURN_ORIGINAL_LOGPROB`` is left off).

Interruption: an engine's :attr:`Engine.interrupt` event, once set, stops
:class:`HFEngine` generation at its next decode step with
:class:`GenerationInterrupted`; nothing of the call is returned, so no partial
generation is ever used. :class:`SGLangEngine` ignores it (a request runs to
its end).
"""
from __future__ import annotations

import abc
import inspect
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample a continuation.

    Attributes:
        max_new_tokens: the most tokens to generate per sequence.
        temperature: softmax temperature; 0 means greedy.
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        stop_token_ids: tokens that end a sequence (kept in the output, finish
            reason ``stop``). ``None`` means the tokenizer's EOS; ``()`` means
            none, so every sequence runs to ``max_new_tokens``.
        seed: seed for this call's sampling; ``None`` uses the engine's own
            random stream.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Generation:
    """One sampled continuation.

    Attributes:
        output_ids: int32[N] generated tokens, including a final stop token if any.
        logprobs: float32[N] behaviour logprob of each generated token (module docstring).
        finish_reason: ``stop`` (a stop token was generated) or ``length``.
        version: the weight version that generated it.
    """

    output_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: Literal["stop", "length"]
    version: int


class GenerationInterrupted(Exception):
    """:meth:`Engine.generate` stopped because the engine's :attr:`Engine.interrupt` was set: the whole
    call is dropped (no generation of it is returned) and the engine stays usable."""


class Engine(abc.ABC):
    """A rollout inference engine for one policy.

    Attributes:
        interrupt: when set, stops a :meth:`generate` in progress (or about to start) with
            :class:`GenerationInterrupted`; None (the default) never interrupts. Checked by
            :class:`HFEngine` before each decode step; :class:`SGLangEngine` ignores it.
    """

    interrupt: threading.Event | None = None

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Any:
        """The policy's Hugging Face tokenizer (for chat templates and decoding)."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The weight version currently loaded (0 for the initial weights)."""

    @abc.abstractmethod
    def generate(self, batch: list[list[int]], sampling: SamplingParams) -> list[Generation]:
        """Sample one continuation per prompt.

        Args:
            batch: prompts as token-id lists (each non-empty).
            sampling: sampling parameters.

        Returns:
            One :class:`Generation` per prompt, in order.

        Raises:
            ValueError: an empty prompt.
            GenerationInterrupted: :attr:`interrupt` was set (engines that check it).
        """

    @abc.abstractmethod
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new weights (all or some parameters by name) and set :attr:`version`.

        Raises:
            KeyError: a name the model does not have.
            ValueError: a tensor whose shape does not match.
        """

    def stop_ids(self, sampling: SamplingParams) -> tuple[int, ...]:
        """The stop tokens for ``sampling``: its own, or the tokenizer's EOS when ``None``."""
        if sampling.stop_token_ids is not None:
            return tuple(sampling.stop_token_ids)
        eos = self.tokenizer.eos_token_id
        return () if eos is None else (eos,)


def _check_prompts(batch: list[list[int]]) -> None:
    for i, ids in enumerate(batch):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} of the batch is empty")


class HFEngine(Engine):
    """A transformers causal LM sampling batches with a KV cache (the CPU default).

    Prompts are left-padded with an attention mask and explicit position ids;
    one prefill pass builds the cache, then each step feeds one token per row.
    Identical prompts (the G samples of a GRPO group) are prefilled once and
    their cache rows copied, as prefix caching does in SGLang and vLLM.
    Rows that have stopped keep running on a pad token (their outputs are
    ignored) until every row stops or ``max_new_tokens`` is reached.
    :attr:`Engine.interrupt` is checked before each decode step (after the
    prefill), so a set interrupt stops a call within one forward pass.

    Args:
        model_dir: a ``save_pretrained`` directory with model and tokenizer.
        device: torch device string.
        dtype: parameter dtype (float32 for exact logprobs on CPU, bfloat16 on GPU).
        max_batch: the most prompts per forward pass; larger batches are split.
        version: the version of the weights in ``model_dir``.
    """

    def __init__(self, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 max_batch: int = 64, version: int = 0) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device)
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()
        self.max_batch = max_batch
        self._version = version
        self._generator = torch.Generator(device=self.device).manual_seed(0)
        pad = self._tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self._tokenizer.eos_token_id or 0)
        self._lock = threading.Lock()
        # the KV-cache argument and output field: `cache` in transformers >= 5.x, `past_key_values` before
        self._cache_name = "cache" if "cache" in inspect.signature(self.model.forward).parameters \
            else "past_key_values"

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def version(self) -> int:
        return self._version

    def generate(self, batch: list[list[int]], sampling: SamplingParams) -> list[Generation]:
        """See :meth:`Engine.generate`.

        Raises:
            ValueError: an empty prompt.
            GenerationInterrupted: :attr:`Engine.interrupt` was set before a decode step.
        """
        _check_prompts(batch)
        gen = self._generator
        if sampling.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(sampling.seed)
        out: list[Generation] = []
        with self._lock, torch.inference_mode():
            for start in range(0, len(batch), self.max_batch):
                out.extend(self._generate_chunk(batch[start:start + self.max_batch], sampling, gen))
        return out

    def _generate_chunk(self, batch: list[list[int]], sampling: SamplingParams,
                        gen: torch.Generator) -> list[Generation]:
        n, width, dev = len(batch), max(map(len, batch)), self.device
        first: dict[tuple[int, ...], int] = {}  # each distinct prompt -> its row in the prefill
        rows = torch.tensor([first.setdefault(tuple(row), len(first)) for row in batch], dtype=torch.long, device=dev)
        ids = torch.full((len(first), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(first), width), dtype=torch.long)
        for i, row in enumerate(first):
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(1) - 1).clamp_(min=0)
        stops = torch.tensor(self.stop_ids(sampling), dtype=torch.long, device=dev)
        steps = sampling.max_new_tokens
        tokens = torch.empty((n, steps), dtype=torch.long, device=dev)
        logps = torch.empty((n, steps), dtype=torch.float32, device=dev)
        done = torch.zeros(n, dtype=torch.bool, device=dev)
        length = torch.full((n,), steps, dtype=torch.long, device=dev)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, logits_to_keep=1)
        cache = getattr(out, self._cache_name)
        if len(first) < n:
            cache.reorder_cache(rows)  # one cache row per sample: index_select on the batch dimension
        logits, mask, next_pos = out.logits[rows, -1], mask[rows], positions[rows, -1:] + 1
        for t in range(steps):
            if self.interrupt is not None and self.interrupt.is_set():
                raise GenerationInterrupted(f"interrupted after {t} of up to {steps} tokens")
            tok, logp = self._sample(logits, sampling, gen)
            tok = tok.masked_fill_(done, self.pad_id)
            tokens[:, t], logps[:, t] = tok, logp
            if stops.numel():
                hit = torch.isin(tok, stops) & ~done
                length = torch.where(hit, t + 1, length)
                done |= hit
                if bool(done.all()):
                    break
            if t + 1 == steps:
                break
            mask = torch.cat([mask, mask.new_ones((n, 1))], 1)
            out = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos,
                             use_cache=True, **{self._cache_name: cache})
            cache, logits = getattr(out, self._cache_name), out.logits[:, -1]
            next_pos = next_pos + 1
        tokens, logps = tokens.cpu().numpy().astype(np.int32), logps.cpu().numpy()
        lengths, stopped = length.cpu().tolist(), done.cpu().tolist()
        return [Generation(output_ids=tokens[i, :lengths[i]].copy(), logprobs=logps[i, :lengths[i]].copy(),
                           finish_reason="stop" if stopped[i] else "length", version=self._version)
                for i in range(n)]

    @staticmethod
    def _sample(logits: torch.Tensor, sampling: SamplingParams,
                gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample a token per row; return (token int64[n], logprob float32[n]) per the module convention."""
        logits = logits.float()
        if sampling.temperature == 0:
            logp = torch.log_softmax(logits, -1)
            tok = logp.argmax(-1)
            return tok, logp.gather(1, tok[:, None])[:, 0]
        logp = torch.log_softmax(logits / sampling.temperature, -1)
        probs = logp.exp()
        if sampling.top_p < 1:
            sorted_p, order = probs.sort(-1, descending=True)
            cut = (sorted_p.cumsum(-1) - sorted_p) >= sampling.top_p
            probs = probs.scatter(1, order, sorted_p.masked_fill(cut, 0.0))
        tok = torch.multinomial(probs, 1, generator=gen)[:, 0]
        return tok, logp.gather(1, tok[:, None])[:, 0]

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        params = self.model.state_dict(keep_vars=True)  # tied weights appear under both names
        for name, value in state_dict.items():
            if name not in params:
                raise KeyError(f"load_weights: the model has no parameter {name!r}")
            if tuple(value.shape) != tuple(params[name].shape):
                raise ValueError(f"load_weights: {name!r} has shape {tuple(value.shape)}, "
                                 f"the model expects {tuple(params[name].shape)}")
        with self._lock, torch.no_grad():
            for name, value in state_dict.items():
                params[name].copy_(value.to(device=params[name].device, dtype=params[name].dtype))
            self._version = int(version)


class SGLangEngine(Engine):
    """A client of an SGLang server (``python -m sglang.launch_server``), for GPUs.

    Generation uses the native ``POST /generate`` with ``input_ids`` and
    ``return_logprob``; weights are loaded with ``POST /update_weights_from_disk``
    (a ``save_pretrained`` directory). HTTP calls are retried with exponential
    backoff on connection errors and 5xx responses. ``SamplingParams.seed`` is
    not sent (the server samples from its own ``--random-seed`` stream).
    :attr:`Engine.interrupt` is ignored: a request runs to its end.

    Args:
        url: the server's base URL; with ``launch=True`` the port is taken from it
            (default ``http://127.0.0.1:30000``).
        model_path: the model directory (also loads the tokenizer locally).
        launch: start a server subprocess (stopped by :meth:`close`); otherwise attach.
        version: the version of the weights the server holds.
        launch_args: extra ``launch_server`` arguments.
        startup_timeout_s: seconds to wait for ``/health`` after a launch.
        timeout_s: per-request HTTP timeout, seconds.

    Raises:
        RuntimeError: the launched server exits or is not healthy within ``startup_timeout_s``.
    """

    def __init__(self, url: str | None = None, model_path: str | Path | None = None, launch: bool = False,
                 version: int = 0, launch_args: tuple[str, ...] = (), startup_timeout_s: float = 600.0,
                 timeout_s: float = 600.0) -> None:
        import httpx
        from transformers import AutoTokenizer

        if model_path is None:
            raise ValueError("SGLangEngine needs model_path (for the tokenizer and for launching)")
        self.url = (url or "http://127.0.0.1:30000").rstrip("/")
        self.model_path = str(model_path)
        self._tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._version = version
        self._client = httpx.Client(base_url=self.url, timeout=timeout_s)
        self._proc: subprocess.Popen | None = None
        if launch:
            self._launch(launch_args, startup_timeout_s)

    def _launch(self, launch_args: tuple[str, ...], startup_timeout_s: float) -> None:
        import httpx

        host, port = httpx.URL(self.url).host, httpx.URL(self.url).port or 30000
        env = dict(os.environ, SGLANG_RETURN_ORIGINAL_LOGPROB="false")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model_path,
             "--host", host, "--port", str(port), *launch_args], env=env)
        deadline = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"sglang.launch_server exited with code {self._proc.returncode}")
            try:
                if self._client.get("/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1.0)
        self.close()
        raise RuntimeError(f"sglang server at {self.url} not healthy after {startup_timeout_s} s")

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def version(self) -> int:
        return self._version

    def _post(self, path: str, payload: dict[str, Any]) -> Any:
        import httpx
        from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

        def transient(exc: BaseException) -> bool:
            if isinstance(exc, httpx.HTTPStatusError):
                return exc.response.status_code >= 500
            return isinstance(exc, httpx.TransportError)

        @retry(retry=retry_if_exception(transient), stop=stop_after_attempt(5),
               wait=wait_exponential(multiplier=0.5, max=10), reraise=True)
        def call() -> Any:
            response = self._client.post(path, json=payload)
            response.raise_for_status()
            return response.json()

        return call()

    def generate(self, batch: list[list[int]], sampling: SamplingParams) -> list[Generation]:
        """See :meth:`Engine.generate`. Raises RuntimeError when the server aborts a request."""
        _check_prompts(batch)
        params: dict[str, Any] = {
            "max_new_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stop_token_ids": list(self.stop_ids(sampling)),
            "ignore_eos": sampling.stop_token_ids is not None,
            "skip_special_tokens": False,
        }
        version = self._version
        result = self._post("/generate", {"input_ids": [list(map(int, b)) for b in batch],
                                          "sampling_params": params, "return_logprob": True})
        if isinstance(result, dict):
            result = [result]
        out = []
        for item in result:
            triples = item["meta_info"]["output_token_logprobs"]  # [(logprob, token_id, text), ...]
            reason = item["meta_info"].get("finish_reason") or {}
            kind = reason.get("type") if isinstance(reason, dict) else str(reason)
            if kind == "abort":
                raise RuntimeError(f"sglang aborted a request: {reason.get('message', reason)}")
            out.append(Generation(
                output_ids=np.array([t[1] for t in triples], dtype=np.int32),
                logprobs=np.array([t[0] for t in triples], dtype=np.float32),
                finish_reason="length" if kind == "length" else "stop", version=version))
        return out

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Save ``state_dict`` into a copy of the model directory and load it with ``/update_weights_from_disk``.

        The state dict must be complete (every parameter): SGLang reloads from disk.

        Raises:
            RuntimeError: the server reports ``success: false``.
        """
        import shutil
        import tempfile

        from safetensors.torch import save_file

        target = Path(tempfile.mkdtemp(prefix=f"astraflow-sglang-v{version}-"))
        for f in Path(self.model_path).iterdir():  # config, tokenizer, generation config; not the weights
            if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".safetensors.index.json")):
                shutil.copy2(f, target / f.name)
        # copies: tied weights share memory, which safetensors refuses to save
        save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in state_dict.items()},
                  target / "model.safetensors")
        try:
            self.load_weights_from_disk(target, version)
        finally:
            shutil.rmtree(target, ignore_errors=True)

    def load_weights_from_disk(self, model_path: str | Path, version: int) -> None:
        """Tell the server to reload weights from ``model_path`` (a ``save_pretrained`` directory).

        Raises:
            RuntimeError: the server reports ``success: false``.
        """
        result = self._post("/update_weights_from_disk", {"model_path": str(model_path)})
        if not result.get("success", False):
            raise RuntimeError(f"sglang update_weights_from_disk({model_path}) failed: {result.get('message')}")
        self._version = int(version)

    def close(self) -> None:
        """Close the HTTP client and stop a launched server."""
        self._client.close()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()

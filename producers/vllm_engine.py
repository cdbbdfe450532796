"""A rollout engine that is a client of a vLLM OpenAI-compatible server (:mod:`producers.vllm_server`).

Generation is ``POST /v1/completions`` with token-id prompts (one choice per prompt, ``n=1``: the G
samples of a group are G identical prompts, which vLLM's prefix cache prefills once), ``logprobs: 0`` and
``return_tokens_as_token_ids`` so each choice carries its token ids (``"token_id:<id>"``) and their
logprobs. The server runs with ``--logprobs-mode processed_logprobs``, so those are the logprobs of the
temperature-scaled distribution it sampled from: the module convention of :mod:`producers.engines`.
vLLM applies top-p before it reports processed logprobs, which the trainer does not, so ``top_p < 1`` is
refused here.

Weights are not pushed through this client: the server's worker extension pulls each version from the
weight store itself (:meth:`VLLMEngine.pull`, ``astraflow_pull`` in :mod:`producers.vllm_worker`), verifies
it against the announcement's checksum and loads only the layers that changed; then the prefix cache is
reset, since cached KV blocks were computed under the old weights. Up to :attr:`VLLMEngine.concurrent_calls`
generations run at once, so a pull waits for the ones in flight to end and holds back new ones until the server
has the new version (:class:`~producers.engines.SwapGate`): no request runs across a swap, and the version each
generation is stamped with is the one every one of its tokens came from.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

import httpx
import numpy as np
import torch

from producers.engines import (Engine, EngineUpdateError, Generation, GenerationInterrupted, SamplingParams,
                               SwapGate, check_prompts)
from producers.vllm_server import SERVED_NAME, wait_healthy

log = logging.getLogger(__name__)


class VLLMEngine(Engine):
    """A client of a vLLM server serving one policy.

    Args:
        url: the server's base URL (``http://host:port``).
        model_dir: the policy's model directory (for the tokenizer, and the server's initial weights,
            version 0).
        startup_timeout_s: how long to wait for ``GET /health`` (a cold CPU server takes minutes).
        request_timeout_s: the bound on one HTTP request.

    Raises:
        RuntimeError: the server did not answer ``/health`` within ``startup_timeout_s``.
    """

    pulls_from_store = True
    concurrent_calls = 16  # the server batches concurrent requests continuously

    def __init__(self, url: str, model_dir: str | Path, startup_timeout_s: float = 600.0,
                 request_timeout_s: float = 600.0):
        from transformers import AutoTokenizer

        self.url = url.rstrip("/")
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self._version = 0
        self._gate = SwapGate()
        self._http = httpx.Client(timeout=request_timeout_s)
        waited = wait_healthy(self.url, startup_timeout_s, what="the vLLM server", log=log.info)
        log.info("vLLM server at %s is healthy (waited %.0f s)", self.url, waited)

    def _post(self, path: str, payload: dict[str, Any] | None = None) -> Any:
        """POST ``payload`` as JSON; the decoded answer.

        Raises:
            RuntimeError: a transport error or a non-2xx answer (endpoint, status and the body's start).
        """
        try:
            r = self._http.post(f"{self.url}{path}", json=payload)
        except httpx.HTTPError as e:
            raise RuntimeError(f"vLLM {path} at {self.url}: {type(e).__name__}: {e}") from None
        if r.status_code // 100 != 2:
            raise RuntimeError(f"vLLM {path} at {self.url} answered {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else None

    def generate(self, batch: list[list[int]], sampling: SamplingParams) -> list[Generation]:
        """One continuation per prompt, from one ``/v1/completions`` request.

        Raises:
            ValueError: an empty prompt, or ``sampling.top_p < 1`` (vLLM's processed logprobs would be
                top-p-renormalised, unlike the trainer's recompute).
            GenerationInterrupted: :attr:`interrupt` was set before the request was sent (a request in
                flight runs to its end), or the request failed once it was set (the server stopping with us).
            RuntimeError: the server failed the request.
        """
        check_prompts(batch)
        if sampling.top_p < 1:
            raise ValueError(f"sampling.top_p={sampling.top_p}: the vLLM engine records logprobs of the "
                             "temperature-scaled distribution only with top_p = 1")
        if self.interrupt is not None and self.interrupt.is_set():
            raise GenerationInterrupted("interrupted before the request was sent")
        stops = list(self.stop_ids(sampling))
        payload = {"model": SERVED_NAME, "prompt": batch, "max_tokens": sampling.max_new_tokens,
                   "temperature": sampling.temperature, "top_p": 1.0, "n": 1, "logprobs": 0,
                   "return_tokens_as_token_ids": True, "stop_token_ids": stops, "ignore_eos": not stops,
                   "skip_special_tokens": False}
        if sampling.stop:  # the token completing a stop string stays in the output, as HFEngine keeps it
            payload |= {"stop": list(sampling.stop), "include_stop_str_in_output": True}
        if sampling.seed is not None:
            payload["seed"] = sampling.seed
        with self._gate.generating():
            version = self._version
            try:
                answer = self._post("/v1/completions", payload)
            except RuntimeError:
                if self.interrupt is not None and self.interrupt.is_set():  # the server went as we stopped
                    raise GenerationInterrupted("interrupted: the request failed while stopping") from None
                raise
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != len(batch):
            raise RuntimeError(f"vLLM answered {len(choices)} choices for {len(batch)} prompts")
        out = []
        for c in choices:
            lp = c["logprobs"]
            ids = np.array([int(t.removeprefix("token_id:")) for t in lp["tokens"]], dtype=np.int32)
            logps = np.array(lp["token_logprobs"], dtype=np.float32)
            reason = "stop" if c["finish_reason"] == "stop" else "length"
            out.append(Generation(output_ids=ids, logprobs=logps, finish_reason=reason, version=version))
        return out

    def pull(self, store_uri: str, run: str, policy: str, version: int, sha256: str | None) -> None:
        """Have the server load ``version`` of ``policy`` from the weight store itself (its worker extension's
        ``astraflow_pull``: the Puller's planner, each object verified, only changed layers loaded), then
        reset its prefix cache and set :attr:`version`; once the generations in flight have ended, and with new
        ones held back until it is done.

        Args:
            store_uri, run, policy, version: which weights.
            sha256: the checksum the result must have (an announcement's); None: the objects' own checks stand
                (offline evaluation, which reads the store without the bus), and the workers must agree.

        Raises:
            EngineUpdateError: the server could not reach or verify the version (it keeps its old weights), or a
                worker reports another checksum than ``sha256`` (or, without one, the workers disagree).
        """
        with self._gate.swapping():
            try:
                results = self._post("/collective_rpc", {"method": "astraflow_pull",
                                                          "args": [store_uri, run, policy, str(version), sha256 or ""]})
            except RuntimeError as e:
                raise EngineUpdateError(f"version {version} of {policy!r} not loaded by the server: {e}") from None
            sums = results.get("results", []) if isinstance(results, dict) else []
            errors = sorted({s for s in sums if str(s).startswith("error:")})
            if errors:
                raise EngineUpdateError(f"version {version} of {policy!r} not loaded by the server: "
                                        f"{'; '.join(errors)}")
            if not sums or any(s != (sha256 or sums[0]) for s in sums):
                raise EngineUpdateError(f"version {version} of {policy!r}: the server's workers report checksums "
                                        f"{sums}, the announcement says {sha256}")
            try:
                self._post("/reset_prefix_cache")
            except RuntimeError as e:  # the next sync pulls again (only what changed) and resets the cache then
                raise EngineUpdateError(f"version {version} of {policy!r} loaded, but the server's prefix cache of "
                                        f"the old weights was not reset: {e}") from None
            self._version = int(version)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Not supported: the server pulls its weights from the store itself (:meth:`pull`).

        Raises:
            TypeError: always.
        """
        raise TypeError("VLLMEngine loads weights through pull(): the vLLM server reads the weight store itself")

    def close(self) -> None:
        """Close the HTTP client (the server is not this client's to stop)."""
        self._http.close()

"""The rollout inference engine contract: :class:`Engine`, :class:`SamplingParams`, :class:`Generation` and the
errors. The engines: :class:`producers.hf_engine.HFEngine` (transformers, the CPU default),
:class:`producers.vllm_engine.VLLMEngine` and :class:`producers.sglang_engine.SGLangEngine` (servers over HTTP).
This module imports no torch, so what only names engines (the launcher's checks, the workflows) starts fast.

An :class:`Engine` turns a batch of prompt token ids into sampled continuations
with their *behaviour logprobs*, and accepts new weights between rollouts.

Logprob convention (shared with the trainer): the behaviour logprob of a
generated token is ``log_softmax(logits / T)[token]``, the log-probability
under the temperature-scaled distribution, where ``T`` is
``SamplingParams.temperature``. The trainer recomputes logprobs with the same
temperature. top-p truncation is *not* reflected (the full temperature-scaled
softmax is used), so with ``top_p < 1`` the recorded value is the probability
before truncation. With ``temperature == 0`` (greedy) logprobs are taken at
``T = 1``. SGLang returns the same quantity, also with ``top_p < 1`` (see
:mod:`producers.sglang_engine`; its ``SGLANG_RETURN_ORIGINAL_LOGPROB`` must be left off).

Interruption: an engine's :attr:`Engine.interrupt` event, once set, stops
:class:`~producers.hf_engine.HFEngine` generation at its next decode step with
:class:`GenerationInterrupted`; nothing of the call is returned, so no partial
generation is ever used. :class:`~producers.sglang_engine.SGLangEngine` ignores it (a request runs to
its end).

Weight updates go through :class:`producers.engine_sync.EngineSync` for every engine: it hands an engine either
the changed tensors of a verified host copy (:meth:`Engine.load_weights`) or, for an engine whose server reads the
store itself (:attr:`Engine.pulls_from_store`), the version to pull. Either loads the new weights and moves
:attr:`Engine.version`, or raises and keeps the old version (:class:`EngineUpdateError` when the
engine could not load them, e.g. its server refused or could not be reached).
"""
from __future__ import annotations

import abc
import contextlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Literal, Mapping

import numpy as np

if TYPE_CHECKING:
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
        stop: strings that end a sequence once its decoded text contains one (the
            tokens up to the one completing it are kept, finish reason ``stop``):
            the end of a tool call (``</tool_call>``), as vLLM's and SGLang's
            ``stop``. ``()``: none.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError(f"SamplingParams.stop has an empty string: {self.stop!r}")


@dataclass
class Generation:
    """One sampled continuation.

    Attributes:
        output_ids: int32[N] generated tokens, including a final stop token if any.
        logprobs: float32[N] behaviour logprob of each generated token (module docstring).
        finish_reason: ``stop`` (a stop token or stop string was generated) or ``length``.
        version: the weight version that generated it.
    """

    output_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: Literal["stop", "length"]
    version: int


class GenerationInterrupted(Exception):
    """:meth:`Engine.generate` stopped because the engine's :attr:`Engine.interrupt` was set: the whole
    call is dropped (no generation of it is returned) and the engine stays usable."""


class EngineUpdateError(RuntimeError):
    """:meth:`Engine.load_weights` could not load a version (e.g. its server refused it or could not be
    reached): :attr:`Engine.version` is unchanged and the engine stays usable; the message says why and
    what the engine holds now. The RaaS worker logs it, keeps rolling out with the old version and
    tries again at its next weight sync."""


class SwapGate:
    """Keeps a server engine's weight swaps apart from its generations: many :meth:`generating` blocks at once, or
    one :meth:`swapping` block alone. A swap waits until the generations in flight have ended, and generations
    asked for once a swap waits, wait for it (writer preference), so a swap is never starved and every token of a
    generation comes from the version it is stamped with.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._generating = 0
        self._swapping = False
        self._swaps_waiting = 0

    @contextlib.contextmanager
    def generating(self) -> Iterator[None]:
        """Hold the gate shared for one generation (blocks while a swap runs or waits)."""
        with self._cv:
            self._cv.wait_for(lambda: not self._swapping and not self._swaps_waiting)
            self._generating += 1
        try:
            yield
        finally:
            with self._cv:
                self._generating -= 1
                self._cv.notify_all()

    @contextlib.contextmanager
    def swapping(self) -> Iterator[None]:
        """Hold the gate alone for one weight swap (blocks until no generation is in flight)."""
        with self._cv:
            self._swaps_waiting += 1
            try:
                self._cv.wait_for(lambda: not self._swapping and not self._generating)
            finally:
                self._swaps_waiting -= 1
            self._swapping = True
        try:
            yield
        finally:
            with self._cv:
                self._swapping = False
                self._cv.notify_all()


class Engine(abc.ABC):
    """A rollout inference engine for one policy.

    Attributes:
        interrupt: when set, stops a :meth:`generate` in progress (or about to start) with
            :class:`GenerationInterrupted`; None (the default) never interrupts. Checked by
            :class:`~producers.hf_engine.HFEngine` before each decode step; ``SGLangEngine`` ignores it.
    """

    interrupt: threading.Event | None = None
    #: True for an engine whose server reads new weight versions from the store itself (``pull(store_uri, run,
    #: policy, version, sha256)``, :class:`producers.vllm_engine.VLLMEngine`) instead of :meth:`load_weights`.
    pulls_from_store: bool = False
    #: The most :meth:`generate` calls in flight at once (:class:`producers.engine_batcher.EngineBatcher`): 1 for an
    #: in-process engine, which batches the requests pending at each call; more for a server that batches
    #: concurrent requests continuously itself.
    concurrent_calls: int = 1

    #: Set by each engine's ``__init__``: the policy's tokenizer, and the version it holds (see the properties).
    _tokenizer: Any = None
    _version: int = 0

    @property
    def tokenizer(self) -> Any:
        """The policy's Hugging Face tokenizer (for chat templates and decoding)."""
        return self._tokenizer

    @property
    def version(self) -> int:
        """The weight version currently loaded (0 for the initial weights)."""
        return self._version

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
            EngineUpdateError: the engine could not load them (engines with a server); the version is unchanged.
        """

    def stop_ids(self, sampling: SamplingParams) -> tuple[int, ...]:
        """The stop tokens for ``sampling``: its own, or the tokenizer's EOS when ``None``."""
        if sampling.stop_token_ids is not None:
            return tuple(sampling.stop_token_ids)
        eos = self.tokenizer.eos_token_id
        return () if eos is None else (eos,)


def check_prompts(batch: list[list[int]]) -> None:
    """Refuse a batch with an empty prompt.

    Raises:
        ValueError: prompt ``i`` of ``batch`` is empty (the message names it).
    """
    for i, ids in enumerate(batch):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} of the batch is empty")

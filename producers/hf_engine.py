"""The transformers rollout engine (:class:`HFEngine`), the CPU default. The engine contract and the logprob
convention are in :mod:`producers.engines`."""
from __future__ import annotations

import inspect
import threading
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from producers.engines import Engine, Generation, GenerationInterrupted, SamplingParams, check_prompts


class HFEngine(Engine):
    """A transformers causal LM sampling batches with a KV cache (the CPU default).

    Prompts are left-padded with an attention mask and explicit position ids;
    one prefill pass builds the cache, then each step feeds one token per row.
    Identical prompts (the G samples of a GRPO group) are prefilled once and
    their cache rows copied, as prefix caching does in SGLang and vLLM.
    A row stops at a stop token or once its generated text holds a stop
    string (``SamplingParams.stop``). Rows that have stopped are dropped from the decode batch (their cache rows
    too) once they are an eighth of it; until then they run on a pad token,
    their outputs ignored. A chunk ends when every row stopped or
    ``max_new_tokens`` is reached.
    :attr:`Engine.interrupt` is checked before each decode step (after the
    prefill), so a set interrupt stops a call within one forward pass.

    Args:
        model_dir: a ``save_pretrained`` directory with model and tokenizer.
        device: torch device string.
        dtype: parameter dtype (float32 for exact logprobs on CPU, bfloat16 on GPU).
        max_batch: the most rows (prompts, a group's G copies counted G times) per forward pass; larger
            batches are split into chunks run one after another. 256 holds a RaaS batch of 16 prompts x 16
            samples: on the tiny model one chunk of 256 rows is about twice as fast as four of 64.
        max_batch_tokens: the most KV-cache positions per chunk, rows x (longest prompt + ``max_new_tokens``):
            long generations get fewer rows per chunk (131072 is 64 rows of a 2048-token context).
        version: the version of the weights in ``model_dir``.
    """

    def __init__(self, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 max_batch: int = 256, max_batch_tokens: int = 131072, version: int = 0) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device)
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()
        self.max_batch, self.max_batch_tokens = max_batch, max_batch_tokens
        self._version = version
        self._generator = torch.Generator(device=self.device).manual_seed(0)
        pad = self._tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self._tokenizer.eos_token_id or 0)
        self._lock = threading.Lock()
        self._stop_ends_cache: dict[tuple[str, ...], torch.Tensor] = {}
        self._joinable: bool | None = None  # whether prefill caches can be joined (_prefill); None: not known yet
        # the KV-cache argument and output field: `cache` in transformers >= 5.x, `past_key_values` before
        self._cache_name = "cache" if "cache" in inspect.signature(self.model.forward).parameters \
            else "past_key_values"

    def generate(self, batch: list[list[int]], sampling: SamplingParams) -> list[Generation]:
        """See :meth:`Engine.generate`.

        Raises:
            ValueError: an empty prompt.
            GenerationInterrupted: :attr:`Engine.interrupt` was set before a decode step.
        """
        check_prompts(batch)
        gen = self._generator
        if sampling.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(sampling.seed)
        out: list[Generation] = []
        positions = max(map(len, batch), default=1) + sampling.max_new_tokens  # per row, at most
        rows = max(1, min(self.max_batch, self.max_batch_tokens // positions))
        with self._lock, torch.inference_mode():
            for start in range(0, len(batch), rows):
                out.extend(self._generate_chunk(batch[start:start + rows], sampling, gen))
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
        logits, cache = self._prefill(ids, mask, positions, [len(row) for row in first])
        stops = torch.tensor(self.stop_ids(sampling), dtype=torch.long, device=dev)
        can_stop = bool(stops.numel() or sampling.stop)
        steps = sampling.max_new_tokens
        tokens = torch.empty((n, steps), dtype=torch.long, device=dev)
        logps = torch.empty((n, steps), dtype=torch.float32, device=dev)
        done = torch.zeros(n, dtype=torch.bool, device=dev)
        length = torch.full((n,), steps, dtype=torch.long, device=dev)
        if len(first) < n:
            cache.reorder_cache(rows)  # one cache row per sample: index_select on the batch dimension
        logits, mask, next_pos = logits[rows], mask[rows], positions[rows, -1:] + 1
        live = torch.arange(n, device=dev)  # the chunk's row of each row in the forward pass
        for t in range(steps):
            if self.interrupt is not None and self.interrupt.is_set():
                raise GenerationInterrupted(f"interrupted after {t} of up to {steps} tokens")
            tok, logp = self._sample(logits, sampling, gen)
            finished = done[live]
            tok = tok.masked_fill_(finished, self.pad_id)
            tokens[live, t], logps[live, t] = tok, logp  # past a row's length: cut off below
            if can_stop:
                hit = torch.isin(tok, stops) & ~finished
                if sampling.stop:
                    hit |= self._stop_string_hits(tokens, live, tok, t, ~finished, sampling.stop)
                length[live[hit]] = t + 1
                done[live[hit]] = True
                finished |= hit
                if bool(finished.all()):
                    break
            if t + 1 == steps:
                break
            if can_stop and 8 * int(finished.sum()) >= len(live):  # drop stopped rows: an eighth of the pass
                keep = (~finished).nonzero()[:, 0]
                cache.reorder_cache(keep)
                live, tok, mask, next_pos = live[keep], tok[keep], mask[keep], next_pos[keep]
            mask = torch.cat([mask, mask.new_ones((len(live), 1))], 1)
            out = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos,
                             use_cache=True, **{self._cache_name: cache})
            cache, logits = getattr(out, self._cache_name), out.logits[:, -1]
            next_pos = next_pos + 1
        tokens, logps = tokens.cpu().numpy().astype(np.int32), logps.cpu().numpy()
        lengths, stopped = length.cpu().tolist(), done.cpu().tolist()
        return [Generation(output_ids=tokens[i, :lengths[i]].copy(), logprobs=logps[i, :lengths[i]].copy(),
                           finish_reason="stop" if stopped[i] else "length", version=self._version)
                for i in range(n)]

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 lengths: list[int]) -> tuple[torch.Tensor, object]:
        """The prefill of left-padded prompts ``ids`` (int64[m, width], with their ``mask`` and ``positions``;
        ``lengths``: each row's prompt length): the last position's logits (float[m, vocab]) and the KV cache.

        Prompts of very different lengths (a batch mixing episodes' first turns with later ones) are prefilled
        in buckets of similar length (:func:`length_buckets`), each over its own width only, and their caches
        are left-padded with zeros (masked out) to the full width and joined, so that a short prompt does not
        pay for the longest one's padding. That needs a cache of plain per-layer key/value tensors (a
        transformers ``DynamicCache`` of ``DynamicLayer``, found at the first prefill); any other is prefilled
        in one pass.
        """
        buckets = length_buckets(lengths) if self._joinable else [list(range(len(lengths)))]
        passes = []
        for bucket in buckets:
            index = torch.tensor(bucket, dtype=torch.long, device=ids.device)
            width = max(lengths[i] for i in bucket)
            out = self.model(input_ids=ids[index, -width:], attention_mask=mask[index, -width:],
                             position_ids=positions[index, -width:], use_cache=True, logits_to_keep=1)
            passes.append((index, out.logits[:, -1], getattr(out, self._cache_name)))
        if self._joinable is None:
            from transformers.cache_utils import DynamicLayer

            layers = getattr(passes[0][2], "layers", None)
            self._joinable = bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
        if len(passes) == 1:
            return passes[0][1], passes[0][2]
        order = torch.cat([index for index, _, _ in passes]).argsort()  # bucket order -> row order
        cache, full = passes[0][2], ids.shape[1]
        for i, layer in enumerate(cache.layers):
            for kind in ("keys", "values"):
                parts = [getattr(c.layers[i], kind) for _, _, c in passes]  # [rows, heads, width, dim] each
                joined = torch.cat([torch.nn.functional.pad(t, (0, 0, full - t.shape[2], 0)) for t in parts])
                setattr(layer, kind, joined[order])
        return torch.cat([logits for _, logits, _ in passes])[order], cache

    def _stop_string_hits(self, tokens: torch.Tensor, live: torch.Tensor, tok: torch.Tensor, t: int,
                          running: torch.Tensor, stop: tuple[str, ...]) -> torch.Tensor:
        """Which rows of the pass complete a stop string with token ``t``: bool[len(live)].

        Only rows still running whose new token decodes to text holding the last character of a stop string
        are decoded, over their last ``max(len(stop)) + 4`` tokens (a token is at least one character), so a
        step costs one vocabulary lookup and a few short decodes. A stop string is matched in generated text
        only (never across the prompt's end), as vLLM and SGLang match it.
        """
        ends = self._stop_ends(stop)
        maybe = (ends.to(tok.device)[tok] & running).nonzero()[:, 0].tolist()
        hits = torch.zeros(len(live), dtype=torch.bool, device=tok.device)
        window = max(map(len, stop)) + 4
        for j in maybe:
            tail = tokens[int(live[j]), max(0, t + 1 - window):t + 1].tolist()
            text = self._tokenizer.decode(tail, skip_special_tokens=False)
            hits[j] = any(s in text for s in stop)
        return hits

    def _stop_ends(self, stop: tuple[str, ...]) -> torch.Tensor:
        """bool[vocab]: the tokens whose text holds the last character of a stop string (cached per ``stop``)."""
        if stop not in self._stop_ends_cache:
            last = {s[-1] for s in stop}
            texts = self._tokenizer.batch_decode([[i] for i in range(len(self._tokenizer))],
                                                 skip_special_tokens=False)
            size = max(len(texts), self.model.get_input_embeddings().num_embeddings)
            ends = torch.zeros(size, dtype=torch.bool)
            ends[:len(texts)] = torch.tensor([any(c in text for c in last) for text in texts], dtype=torch.bool)
            self._stop_ends_cache[stop] = ends
        return self._stop_ends_cache[stop]

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


#: What a prefill pass costs beyond its token positions, in positions: a bucket of shorter prompts is split off
#: only when it saves more padded positions than this (:func:`length_buckets`). On the tiny CPU models a pass of
#: one 5-token row takes 0.7 ms, and 64 rows of 20 tokens 21 ms: about 40 positions of fixed cost.
PASS_COST_POSITIONS = 64


def length_buckets(lengths: list[int], pass_cost: int = PASS_COST_POSITIONS) -> list[list[int]]:
    """Split rows of prompt lengths ``lengths`` into buckets of contiguous length (indices into ``lengths``),
    each prefilled at its longest length, minimising the padded positions plus ``pass_cost`` per bucket: an
    exact dynamic programme over the distinct lengths (O(d^2), d distinct lengths). Buckets go from the longest
    lengths to the shortest, their indices ascending: one bucket, ``[0, ..., n-1]``, when splitting saves
    nothing."""
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_length.setdefault(n, []).append(i)
    distinct = sorted(by_length, reverse=True)
    counts = [len(by_length[n]) for n in distinct]
    # best[j]: the cost of the first j distinct lengths (longest first); cut[j]: where its last bucket starts
    best, cut = [0] + [0] * len(distinct), [0] * (len(distinct) + 1)
    for j in range(1, len(distinct) + 1):
        rows, best[j] = 0, None
        for i in range(j - 1, -1, -1):  # the last bucket holds distinct lengths i..j-1, its width distinct[i]
            rows += counts[i]
            cost = best[i] + rows * distinct[i] + pass_cost
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    buckets, j = [], len(distinct)
    while j > 0:
        buckets.append(sorted(k for n in distinct[cut[j]:j] for k in by_length[n]))
        j = cut[j]
    return buckets[::-1]

#!/usr/bin/env python
"""Build the tiny search-agent model of the search demo (no download).

Same architecture and character tokenizer as the tiny arithmetic model
(``build_tokenizer`` and ``build_model`` of ``scripts/make_tiny_model.py``): a
~330k-parameter Qwen2 whose chat template renders ``<bos>`` and the message
contents. It is pre-trained by SFT on complete search episodes over the
knowledge base ``producers/data/search_kb.jsonl`` (``scripts/make_search_kb.py``)::

    <bos>code of kavor?\\n                        prompt (context)
    <search>kavor</search>                        model turn 1 (trained)
    \\n<result>the code of kavor is 381</result>\\n  search result (context)
    381<eos>                                      model turn 2 (trained)

with the loss on the two model turns only (``<eos>`` included), entities and
codes drawn from the knowledge base. Training runs in chunks of
:data:`EVAL_EVERY` steps. The model first learns to copy the name into the
search call, then (after a plateau, a phase change whose step varies with the
seed, ~150-400 steps) to copy the code from the result. A chunk's training
episodes give a free estimate of the accuracy: their mean probability of the
whole episode (both turns, teacher-forced). Once that estimate reaches
:data:`ESTIMATE_GATE`, the learning rate drops to :data:`LATE_LR_FACTOR` of its
value and each chunk is followed by :func:`sampled_accuracy`, which
plays :data:`EVAL_QUESTIONS` questions as whole episodes at temperature 1 (what
the ``search_agent`` workflow does, with the retrieval replaced by the exact
knowledge-base lookup of the searched name: :func:`lookup`), and training stops
as soon as that accuracy is within ``[ACC_STOP, ACC_RANGE[1]]``, inside the
target band :data:`ACC_RANGE`, so that RL has room to improve it.

Usage: ``scripts/make_tiny_search_model.py [--out DIR] [--steps N] [--seed S]``;
without ``--out`` it builds (once) into the shared cache
(:func:`weights.models.built_model_dir` of ``tiny-search``) and prints the
directory. ``--temperature T`` prints the sampled accuracy at ``T`` over all 512
questions of the model in ``--out`` (or the cached one), building it first only if it is missing.
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
KB_PATH = ROOT / "producers" / "data" / "search_kb.jsonl"
QA_PATH = ROOT / "producers" / "data" / "search_qa.jsonl"

SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
RESULT_TEMPLATE = "\n<result>{result}</result>\n"
NO_RESULTS = "no results"
MAX_TURNS = 2
MAX_NEW_TOKENS = 24
ACC_RANGE = (0.2, 0.5)
ACC_STOP = 0.25  # stop once sampled accuracy reaches this (and is at most ACC_RANGE[1])
EVAL_EVERY = 5
ESTIMATE_GATE = 0.1  # sample episodes only once the training episodes' mean probability reaches this
LATE_LR_FACTOR = 0.3  # then the learning rate drops to this fraction, so the accuracy climbs through the band slowly
EVAL_QUESTIONS = 256
WARMUP_STEPS = 10


def _tiny_module():
    """``scripts/make_tiny_model.py`` as a module (its ``build_tokenizer`` and ``build_model``)."""
    name = "make_tiny_model"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().with_name("make_tiny_model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, in order (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_kb(path: Path = KB_PATH) -> dict[str, str]:
    """The knowledge base as ``{name: document text}`` (``doc_id`` -> ``text``)."""
    return {doc["doc_id"]: doc["text"] for doc in read_jsonl(path)}


def lookup(kb: dict[str, str], query: str) -> str:
    """The simulated search tool: the document of the entity named ``query`` (stripped), else :data:`NO_RESULTS`."""
    return kb.get(query.strip(), NO_RESULTS)


def search_call(text: str) -> str | None:
    """The query of the first complete ``<search>...</search>`` call in ``text``, or None."""
    start = text.find(SEARCH_OPEN)
    if start < 0:
        return None
    end = text.find(SEARCH_CLOSE, start + len(SEARCH_OPEN))
    return None if end < 0 else text[start + len(SEARCH_OPEN):end]


def episode_parts(name: str, document: str, code: str) -> list[tuple[str, bool]]:
    """A complete episode as ``(text, trained)`` parts after ``<bos>``: question, search call, result, answer.

    The ``<eos>`` that ends the answer is not in the text (:func:`_batch` appends its id).
    """
    return [(f"code of {name}?\n", False), (f"{SEARCH_OPEN}{name}{SEARCH_CLOSE}", True),
            (RESULT_TEMPLATE.format(result=document), False), (code, True)]


def _batch(tokenizer, docs: list[tuple[str, str, str]], rng: random.Random,
           n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n SFT episodes of entities drawn from ``docs`` (name, document, code), right-padded: ids int64[n, T] and
    labels int64[n, T] (-100 off the model turns)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows, labels = [], []
    for _ in range(n):
        name, document, code = rng.choice(docs)
        ids, lab = [tokenizer.bos_token_id], [-100]
        for text, trained in episode_parts(name, document, code):
            part = tokenizer.encode(text, add_special_tokens=False)
            ids += part
            lab += part if trained else [-100] * len(part)
        ids.append(eos)
        lab.append(eos)
        rows.append(ids)
        labels.append(lab)
    width = max(map(len, rows))
    return (torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
            torch.tensor([r + [-100] * (width - len(r)) for r in labels]))


@torch.inference_mode()
def sample(model, tokenizer, contexts: list[list[int]], max_new_tokens: int, temperature: float,
           gen: torch.Generator) -> list[list[int]]:
    """Sample up to ``max_new_tokens`` tokens after each context (left-padded batch, KV cache).

    Args:
        contexts: token ids per row (non-empty lists).
        temperature: softmax temperature (> 0); no top-k or top-p.
        gen: the random generator.

    Returns:
        The new tokens of each row: up to and including its first ``<eos>``, else ``max_new_tokens`` of them.
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    n, width = len(contexts), max(map(len, contexts))
    ids = torch.full((n, width), pad, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, row in enumerate(contexts):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    positions = (mask.cumsum(1) - 1).clamp_(min=0)
    cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    next_pos = positions[:, -1:] + 1
    tokens = torch.full((n, max_new_tokens), pad, dtype=torch.long)
    done = torch.zeros(n, dtype=torch.bool)
    for t in range(max_new_tokens):
        probs = torch.softmax(out.logits[:, -1].float() / temperature, -1)
        tok = torch.multinomial(probs, 1, generator=gen)[:, 0].masked_fill_(done, pad)
        tokens[:, t] = tok
        done |= tok == eos
        if bool(done.all()) or t + 1 == max_new_tokens:
            break
        mask = torch.cat([mask, mask.new_ones((n, 1))], 1)
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos, use_cache=True,
                    **{cache_name: getattr(out, cache_name)})
        next_pos = next_pos + 1
    return [row[:row.index(eos) + 1] if eos in row else row for row in tokens.tolist()]


def _cut_after_call(tokenizer, ids: list[int]) -> list[int]:
    """``ids`` cut just after the first complete search call (unchanged when there is none): the shortest
    prefix whose text (special tokens skipped) holds a complete call."""
    if search_call(tokenizer.decode(ids, skip_special_tokens=True)) is None:
        return ids
    return next(ids[:k] for k in range(1, len(ids) + 1)
                if search_call(tokenizer.decode(ids[:k], skip_special_tokens=True)) is not None)


def play_episodes(model, tokenizer, qa: list[dict[str, str]], kb: dict[str, str], temperature: float = 1.0,
                  seed: int = 0, max_turns: int = MAX_TURNS,
                  max_new_tokens: int = MAX_NEW_TOKENS) -> list[dict[str, Any]]:
    """Play each question of ``qa`` once as a search episode, as the ``search_agent`` workflow does.

    Each turn samples up to ``max_new_tokens`` tokens, cut just after the first
    complete ``<search>...</search>``; a turn with a complete call, before the
    last of ``max_turns``, gets ``\\n<result>{lookup(kb, query)}</result>\\n``
    appended as context and the episode takes another turn.

    Returns:
        Per question, ``{"question", "answer", "turns": [turn texts], "searches": [queries], "correct": bool}``;
        ``correct`` when the last turn's text up to ``<eos>`` or a newline, stripped
        (:func:`producers.rewards.strip_to_eos`, as the ``search`` reward), is the answer.
    """
    from producers.rewards import strip_to_eos

    gen = torch.Generator().manual_seed(seed)
    bos = tokenizer.bos_token_id
    contexts = [[bos] + tokenizer.encode(q["question"], add_special_tokens=False) for q in qa]
    episodes = [{"question": q["question"], "answer": q["answer"], "turns": [], "searches": []} for q in qa]
    active = list(range(len(qa)))
    for turn in range(1, max_turns + 1):
        if not active:
            break
        outs = sample(model, tokenizer, [contexts[i] for i in active], max_new_tokens, temperature, gen)
        still = []
        for i, ids in zip(active, outs):
            ids = _cut_after_call(tokenizer, ids)
            text = tokenizer.decode(ids, skip_special_tokens=True)
            episodes[i]["turns"].append(text)
            query = search_call(text)
            if query is not None and turn < max_turns:
                episodes[i]["searches"].append(query)
                contexts[i] = contexts[i] + ids + tokenizer.encode(
                    RESULT_TEMPLATE.format(result=lookup(kb, query)), add_special_tokens=False)
                still.append(i)
        active = still
    for ep in episodes:
        ep["correct"] = strip_to_eos(ep["turns"][-1]) == ep["answer"]
    return episodes


def sampled_accuracy(model, tokenizer, qa: list[dict[str, str]], kb: dict[str, str], temperature: float = 1.0,
                     seed: int = 0) -> tuple[float, float]:
    """``(accuracy, search_rate)`` of :func:`play_episodes` over ``qa``: the fraction answered correctly, and the
    fraction whose first search call names the question's entity exactly."""
    model.eval()
    episodes = play_episodes(model, tokenizer, qa, kb, temperature, seed)
    acc = sum(ep["correct"] for ep in episodes) / len(episodes)
    hits = sum(bool(ep["searches"]) and ep["searches"][0] == q["entity"] for ep, q in zip(episodes, qa))
    return acc, hits / len(episodes)


def make_tiny_search_model(out_dir: str | Path, steps: int = 600, seed: int = 0, batch_size: int = 64,
                           lr: float = 3e-3, verbose: bool = True) -> Path:
    """Build, pre-train and save the tiny search model and tokenizer to ``out_dir``.

    Args:
        out_dir: directory to write (``save_pretrained`` layout, float32 safetensors).
        steps: the most SFT steps of ``batch_size`` episodes; training stops earlier, at a multiple of
            :data:`EVAL_EVERY` steps, once the sampled accuracy is within ``[ACC_STOP, ACC_RANGE[1]]``.
        seed: seed for initialisation, data and evaluation sampling.
        batch_size: episodes per step.
        lr: AdamW learning rate (linear warm-up over the first :data:`WARMUP_STEPS` steps; betas (0.9, 0.95),
            weight decay 0.1).
        verbose: print progress and the final sampled accuracy.

    Returns:
        ``out_dir`` as a Path. ``out_dir/calibration.json`` records the steps, the sampled accuracy (temperature
        1, the first :data:`EVAL_QUESTIONS` questions of ``search_qa.jsonl``), the fraction of first searches
        that named the entity, the seconds spent, the seed and the parameter count.
    """
    tiny = _tiny_module()
    out = Path(out_dir)
    start = time.perf_counter()
    kb = load_kb()
    qa = read_jsonl(QA_PATH)[:EVAL_QUESTIONS]
    docs = [(name, text, text.rsplit(" ", 1)[1]) for name, text in kb.items()]
    tokenizer = tiny.build_tokenizer()
    model = tiny.build_model(len(tokenizer), seed, tokenizer.pad_token_id, tokenizer.bos_token_id,
                             tokenizer.eos_token_id)
    # weight decay and beta2 0.95 shorten the plateau before the code copy: the phase change came at 150-230 steps
    # for 5 of seeds 0-5 and at 380 for the sixth; without them, 150-220 steps for seeds 0-1 and ~590 for seed 2
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = random.Random(seed)
    model.set_attn_implementation("eager")  # faster than sdpa at this size on CPU; not saved in config.json
    acc, hits, estimate, done, late, measured = 0.0, 0.0, 0.0, 0, False, False
    while done < steps:
        model.train()
        probs = []
        for _ in range(min(EVAL_EVERY, steps - done)):
            ids, labels = _batch(tokenizer, docs, rng, batch_size)
            logits = model(input_ids=ids).logits[:, :-1].float()
            target = labels[:, 1:]
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100,
                                                    reduction="none")  # [n, T-1], 0 off the model turns
            loss = nll.sum() / (target != -100).sum()
            probs.append(torch.exp(-nll.detach().sum(1)).mean().item())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for group in opt.param_groups:
                group["lr"] = lr * min(1.0, (done + 1) / WARMUP_STEPS) * (LATE_LR_FACTOR if late else 1.0)
            opt.step()
            done += 1
        estimate = sum(probs) / len(probs)
        measured = estimate >= ESTIMATE_GATE
        if measured:
            acc, hits = sampled_accuracy(model, tokenizer, qa, kb, 1.0, seed)
            late = True
        if verbose and (measured or done % 25 == 0):
            shown = f"  searched right {hits:.3f}  sampled accuracy {acc:.3f}" if measured else ""
            print(f"step {done:4d}  loss {loss.item():.3f}  episode probability {estimate:.3f}{shown}  "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
        if measured and ACC_STOP <= acc <= ACC_RANGE[1]:
            break
    if not measured:  # the last chunk's accuracy, for the record
        acc, hits = sampled_accuracy(model, tokenizer, qa, kb, 1.0, seed)
    if verbose and not ACC_RANGE[0] <= acc <= ACC_RANGE[1]:
        print(f"warning: sampled accuracy {acc:.3f} is outside {ACC_RANGE} after {done} steps", flush=True)
    model.set_attn_implementation("sdpa")
    seconds = time.perf_counter() - start
    tiny.save_built(model, tokenizer, out, {
        "task": "search", "steps": done, "sampled_accuracy": acc, "searched_right": hits,
        "episode_probability": round(estimate, 4), "eval_questions": len(qa), "temperature": 1.0,
        "seconds": round(seconds, 2), "seed": seed})
    if verbose:
        print(f"saved to {out} after {done} steps, {seconds:.1f} s; sampled accuracy {acc:.3f}")
    return out


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None,
                        help="output directory (default: the shared cache, weights.models.built_model_dir)")
    parser.add_argument("--steps", type=int, default=600, help="most SFT steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=None,
                        help="only measure the sampled accuracy of the built model at this temperature")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.out is None or args.temperature is not None:
        if args.out is None:
            sys.path.insert(0, str(ROOT))
            from weights.models import built_model_dir

            out = built_model_dir("tiny-search")
        else:
            out = Path(args.out)
            if not (out / "config.json").exists():
                make_tiny_search_model(out, steps=args.steps, seed=args.seed)
        if args.temperature is None:
            print(out)
            return
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(out)
        acc, hits = sampled_accuracy(model, tokenizer, read_jsonl(QA_PATH), load_kb(), args.temperature, args.seed)
        print(json.dumps({"model": str(out), "temperature": args.temperature, "questions": 512,
                          "sampled_accuracy": round(acc, 4), "searched_right": round(hits, 4)}))
    else:
        make_tiny_search_model(args.out, steps=args.steps, seed=args.seed)


if __name__ == "__main__":
    main()

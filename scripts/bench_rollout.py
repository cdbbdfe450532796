#!/usr/bin/env python
"""Rollout throughput of one RaaS batch (16 prompts x 16 samples) on the tiny model, four ways, in the same run.

(a) plain transformers ``model.generate(do_sample=True, num_return_sequences=16)`` over the 16 left-padded
    prompts: the baseline;
(b) :class:`~producers.hf_engine.HFEngine`, one ``generate`` call per prompt (its 16 copies), as the RaaS worker
    rolled out a batch before cross-prompt batching;
(c) HFEngine, one ``generate`` call for the batch's 256 rows, as ``single_turn``'s ``run_batch`` does;
(d) vLLM (:class:`~producers.vllm_server.VLLMServer` + :class:`~producers.vllm_engine.VLLMEngine`, one
    ``/v1/completions`` request for the 256 rows), when ``.venv-vllm/bin/python`` exists (skipped with the
    reason otherwise, or with ``--no-vllm``). Its server start is reported on its own and is not part of any
    throughput; it runs after (a)-(c), with ``OMP_NUM_THREADS`` = ``--threads``, so that neither disturbs the other.

All sample at temperature 1 (no top-k, no top-p) from arithmetic prompts (``a+b=``) and ignore EOS, so every
row generates exactly ``max_new_tokens`` tokens and all four count the same tokens. For each ``max_new_tokens``
(4, as ``examples/arith-tiny.yaml``, and 32; ``--quick`` too; the full run adds 128), each way is warmed up once,
then the ways run in interleaved rounds (a b c, c b a, ...: 3 rounds with ``--quick``, 5 by default); each way's
figure is its best round, which damps noise from other load, and every round's figure and their spread are
reported with it, as is the ratio (c)/(a) of every round.

Prints tokens per second (generated tokens only) and seconds per batch of each way, then one JSON line:
``{"metric": "rollout_tokens_per_s", "value": (c), "baseline": (a), "ratio": (c)/(a), "ratio_spread": {"runs",
"median", "min", "max"}, ...}`` at the largest ``max_new_tokens``, with ``batching_speedup`` ((c)/(b)), (b) and
(d), and every setting's figures (each way's ``tokens_per_s_spread``) under ``runs``.

Usage: ``scripts/bench_rollout.py [--quick] [--no-vllm] [--model DIR] [--threads N]``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from weights.models import tiny_model_dir  # noqa: E402
from producers.engines import SamplingParams  # noqa: E402
from producers.hf_engine import HFEngine  # noqa: E402
from producers.workflows import prompt_ids  # noqa: E402
from scripts.spread import describe, interleaved, spread  # noqa: E402

N_PROMPTS, G = 16, 16
NAMES = {"hf_generate": "(a) model.generate", "per_prompt": "(b) HFEngine, a call per prompt",
         "batched": "(c) HFEngine, one call", "vllm": "(d) vLLM, one request"}


def timed_rounds(ways: dict[str, Callable[[], int]], rounds: int) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Each way's wall time (s) in each of ``rounds`` interleaved rounds (after one warm-up each), and its token
    count.

    Raises:
        RuntimeError: the ways generated different numbers of tokens.
    """
    for fn in ways.values():
        fn()  # warm-up
    times, counts = {name: [] for name in ways}, {}
    for _, name in interleaved(list(ways), rounds):
        start = time.perf_counter()
        counts[name] = ways[name]()
        times[name].append(time.perf_counter() - start)
    if len(set(counts.values())) != 1:
        raise RuntimeError(f"token counts differ: {counts}")
    return times, counts


def report(times: dict[str, list[float]], counts: dict[str, int], into: dict[str, dict]) -> None:
    """Print each way's figures and add them to ``into`` (name -> {tokens_per_s (best round), s_per_batch (best),
    tokens_per_s_spread: every round's tokens/s, median, min, max})."""
    for name, seconds in times.items():
        rates = spread([counts[name] / t for t in seconds], 1)
        into[name] = {"tokens_per_s": rates["max"], "s_per_batch": round(min(seconds), 4),
                      "tokens_per_s_spread": rates}
        print(f"  {NAMES[name]:34s} {rates['max']:10.1f} tokens/s (best)  {min(seconds):8.3f} s per batch; "
              f"tokens/s {describe(rates, '.0f')}", flush=True)


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="max_new_tokens 4 and 32, 3 rounds (a few minutes)")
    parser.add_argument("--no-vllm", action="store_true", help="skip (d)")
    parser.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads, also the vLLM server's OMP_NUM_THREADS (1 is steadiest on a "
                             "shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings, rounds = ((4, 32), 3) if args.quick else ((4, 32, 128), 5)
    model_dir = Path(args.model) if args.model else tiny_model_dir()

    engine = HFEngine(model_dir, dtype=torch.float32)
    model, tok = engine.model, engine.tokenizer
    rng = random.Random(0)
    texts: list[str] = []
    while len(texts) < N_PROMPTS:
        text = f"{rng.randint(0, 19)}+{rng.randint(0, 19)}="
        if text not in texts:
            texts.append(text)
    prompts = [prompt_ids(tok, t) for t in texts]
    rows = [p for p in prompts for _ in range(G)]
    width = max(map(len, prompts))
    ids = torch.tensor([[engine.pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    print(f"{N_PROMPTS} prompts x {G} samples ({len(rows)} rows), temperature 1, EOS ignored; best of {rounds} "
          f"rounds; {args.threads} torch thread(s); HFEngine max_batch {engine.max_batch}", flush=True)

    runs: dict[int, dict[str, dict]] = {}
    for new_tokens in settings:
        sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, stop_token_ids=())

        def hf_generate() -> int:
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                     top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     num_return_sequences=G, pad_token_id=engine.pad_id)
            return (out.shape[1] - width) * out.shape[0]

        def per_prompt() -> int:
            return sum(len(g.output_ids) for p in prompts for g in engine.generate([p] * G, sampling))

        def batched() -> int:
            return sum(len(g.output_ids) for g in engine.generate(rows, sampling))

        print(f"max_new_tokens {new_tokens}:", flush=True)
        runs[new_tokens] = {}
        times, counts = timed_rounds({"hf_generate": hf_generate, "per_prompt": per_prompt, "batched": batched},
                                  rounds)
        report(times, counts, runs[new_tokens])

    vllm: dict[str, float | str | None] = {"start_s": None, "skipped": None}
    python = ROOT / ".venv-vllm" / "bin" / "python"
    if args.no_vllm:
        vllm["skipped"] = "--no-vllm"
    elif not python.exists():
        vllm["skipped"] = f"no {python.relative_to(ROOT)} (scripts/install_vllm.sh makes it)"
    else:
        from producers.vllm_engine import VLLMEngine
        from producers.vllm_server import VLLMServer

        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        log_path = Path(tempfile.mkdtemp(prefix="bench-vllm-")) / "server.log"
        print(f"starting the vLLM server (log {log_path})", flush=True)
        start = time.perf_counter()
        try:
            with VLLMServer(model_dir, log_path, dtype="float32", python=python) as server:
                server.wait_healthy(900)
                vllm["start_s"] = round(time.perf_counter() - start, 1)
                print(f"vLLM server up in {vllm['start_s']:.1f} s (not counted below)", flush=True)
                client = VLLMEngine(server.url, model_dir, startup_timeout_s=60)
                try:
                    for new_tokens in settings:
                        sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, top_p=1.0,
                                                  stop_token_ids=())
                        ways = {"vllm": lambda s=sampling: sum(len(g.output_ids) for g in client.generate(rows, s))}
                        times, counts = timed_rounds(ways, rounds)
                        if counts["vllm"] != len(rows) * new_tokens:
                            raise RuntimeError(f"vLLM generated {counts['vllm']} tokens, not {len(rows) * new_tokens}")
                        print(f"max_new_tokens {new_tokens}:", flush=True)
                        report(times, counts, runs[new_tokens])
                finally:
                    client.close()
        except (RuntimeError, OSError) as e:
            vllm["skipped"] = f"the vLLM server failed: {e}".splitlines()[0]
    if vllm["skipped"]:
        print(f"(d) vLLM skipped: {vllm['skipped']}", flush=True)

    last = runs[settings[-1]]
    per_round = zip(last["batched"]["tokens_per_s_spread"]["runs"], last["hf_generate"]["tokens_per_s_spread"]["runs"])
    ratio = spread([c / a for c, a in per_round], 3)
    print(f"(c)/(a) at {settings[-1]} tokens, round by round: {describe(ratio, '.2f')}")
    print("batching speedup (c)/(b): " + ", ".join(
        f"{nt} tokens {r['batched']['tokens_per_s'] / r['per_prompt']['tokens_per_s']:.2f}x" for nt, r in runs.items()))
    print(json.dumps({
        "metric": "rollout_tokens_per_s", "value": last["batched"]["tokens_per_s"],
        "baseline": last["hf_generate"]["tokens_per_s"],
        "ratio": round(last["batched"]["tokens_per_s"] / last["hf_generate"]["tokens_per_s"], 3), "ratio_spread": ratio,
        "max_new_tokens": settings[-1], "prompts": N_PROMPTS, "samples": G,
        "per_prompt_tokens_per_s": last["per_prompt"]["tokens_per_s"],
        "batching_speedup": round(last["batched"]["tokens_per_s"] / last["per_prompt"]["tokens_per_s"], 3),
        "vllm_tokens_per_s": last["vllm"]["tokens_per_s"] if "vllm" in last else None,
        "vllm_start_s": vllm["start_s"], "vllm_skipped": vllm["skipped"], "threads": args.threads,
        "runs": {str(nt): r for nt, r in runs.items()}}))


if __name__ == "__main__":
    main()

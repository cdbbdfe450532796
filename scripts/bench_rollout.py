#!/usr/bin/env python
"""Rollout throughput: HFEngine against plain ``model.generate(do_sample=True)``, in the same run.

Both sample at temperature 1 (no top-k, no top-p) from the tiny model
(``scripts/make_tiny_model.py``, float32, CPU) on the same left-padded batch
of arithmetic prompts, and both ignore EOS so every row generates exactly
``new_tokens`` tokens. Runs alternate between the two (after one warm-up
each) and the best time of each is kept, which damps noise from other load.

Prints both throughputs, then one JSON line:
``{"metric": "rollout_tokens_per_s", "value": ours, "baseline": hf_generate, "ratio": ours / hf_generate}``
(tokens per second, generated tokens only).

Usage: ``scripts/bench_rollout.py [--quick] [--model DIR] [--threads N]``.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astraflow.models import tiny_model_dir  # noqa: E402
from producers.engines import HFEngine, SamplingParams  # noqa: E402


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 16, 32 new tokens, 5 rounds")
    parser.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1 is steadiest on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch, new_tokens, rounds = (16, 32, 5) if args.quick else (64, 128, 5)

    engine = HFEngine(args.model or tiny_model_dir(), dtype=torch.float32, max_batch=batch)
    model, tok = engine.model, engine.tokenizer
    rng = random.Random(0)
    texts = [f"{rng.randint(0, 19)}+{rng.randint(0, 19)}=" for _ in range(batch)]
    prompts = [tok.encode(t) for t in texts]
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, stop_token_ids=())

    width = max(map(len, prompts))
    ids = torch.tensor([[engine.pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def ours() -> int:
        return sum(len(g.output_ids) for g in engine.generate(prompts, sampling))

    def hf_generate() -> int:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=engine.pad_id)
        return (out.shape[1] - width) * out.shape[0]

    best = {"ours": float("inf"), "hf": float("inf")}
    counts = {}
    for name, fn in (("ours", ours), ("hf", hf_generate)):
        fn()  # warm-up
    for _ in range(rounds):
        for name, fn in (("ours", ours), ("hf", hf_generate)):
            start = time.perf_counter()
            counts[name] = fn()
            best[name] = min(best[name], time.perf_counter() - start)
    if counts["ours"] != counts["hf"]:
        raise RuntimeError(f"token counts differ: ours {counts['ours']}, model.generate {counts['hf']}")
    ours_tps, hf_tps = counts["ours"] / best["ours"], counts["hf"] / best["hf"]
    print(f"batch {batch}, {new_tokens} new tokens, best of {rounds}, {args.threads} threads")
    print(f"HFEngine.generate:      {ours_tps:10.1f} tokens/s ({best['ours']:.3f} s)")
    print(f"model.generate(sample): {hf_tps:10.1f} tokens/s ({best['hf']:.3f} s)")
    print(json.dumps({"metric": "rollout_tokens_per_s", "value": round(ours_tps, 1),
                      "baseline": round(hf_tps, 1), "ratio": round(ours_tps / hf_tps, 3)}))


if __name__ == "__main__":
    main()

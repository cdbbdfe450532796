#!/usr/bin/env python
"""Benchmark the sparse bf16 weight delta on real optimizer steps.

A transformers causal LM (by default a small Qwen2 built locally with random
init; ``--model DIR`` loads one from disk) trains with AdamW on GSM8K text
(bytes as token ids) at learning rates 1e-7, 1e-6, 1e-5 and 1e-4. Master
weights are fp32 with a bf16 autocast forward, and what is published is the
bf16 cast, as a mixed-precision trainer would publish. After each step the
delta between consecutive bf16 versions is encoded and decoded
(:mod:`weights.codec`), and the script reports per step:

- sparsity: fraction of bf16 elements bit-identical to the previous version;
- delta bytes / full bf16 bytes;
- delta bytes / the paper's format (uint64 index + 2-byte value per changed
  element, uncompressed: 10 bytes per change; AstraFlow paper, "Weights");
- encode and decode GB/s (full bf16 bytes / seconds; decode includes the
  checksum verification), and memcpy GB/s of the same bytes, measured here.

Timings are CPU seconds of this process (``time.process_time``), best of
``--repeats``, for encode, decode and memcpy alike, so that other processes on
a shared machine do not skew the ratios.

Each step is a repetition: every step's figures are printed, and the summary gives each ratio's median over
the steps with its spread (min, max). Ends with one JSON line for lr=1e-6 (medians over steps, and under
``spread`` every step's sparsity, delta/paper format, encode/memcpy and decode/memcpy with their min and max).
``--quick`` (3 steps per learning rate) takes ~1 minute on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from weights.codec import apply_delta, bits, encode_delta

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.spread import spread  # noqa: E402

DATA = Path("/work/shared/data/gsm8k_train.jsonl")
LRS = (1e-7, 1e-6, 1e-5, 1e-4)


def build_model(model_dir: str | None, hidden: int = 256, layers: int = 4) -> torch.nn.Module:
    """The causal LM in fp32: from ``model_dir``, or a random-init Qwen2 (``hidden``, ``layers``, vocab 1000)."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if model_dir:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = Qwen2Config(vocab_size=1000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                      max_position_embeddings=512,
                      tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg)


def batches(vocab: int, batch: int, seq: int):
    """Endless (batch, seq) int64 batches of GSM8K questions+answers as UTF-8 bytes (ids clipped to ``vocab``)."""
    lines = [json.loads(x) for x in DATA.read_text().splitlines()[:2000]]
    text = "\n".join(r["question"] + " " + r["answer"] for r in lines).encode()
    ids = torch.tensor(list(text), dtype=torch.int64).clamp_(max=vocab - 1)
    pos = 0
    while True:
        if pos + batch * seq >= ids.numel():
            pos = 0
        yield ids[pos:pos + batch * seq].view(batch, seq)
        pos += batch * seq


def bf16_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}


def memcpy_gbps(state: dict[str, torch.Tensor], nbytes: int, repeats: int = 3) -> float:
    src = {k: bits(v) for k, v in state.items()}
    dst = {k: np.empty_like(v) for k, v in src.items()}
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        for k, v in src.items():
            np.copyto(dst[k], v)
        best = min(best, time.process_time() - t0)
    return nbytes / best / 1e9


def run_lr(lr: float, steps: int, args) -> list[dict]:
    model = build_model(args.model, args.hidden, args.layers)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    data = batches(model.config.vocab_size, args.batch, args.seq)
    prev = bf16_state(model)
    full = sum(v.numel() * v.element_size() for v in prev.values())
    rows = []
    for step in range(1, steps + 1):
        x = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        new = bf16_state(model)
        # best of `repeats` for encode, decode and memcpy alike (the machine may be shared)
        enc = dec = float("inf")
        for _ in range(args.repeats):
            t0 = time.process_time()
            d = encode_delta(prev, new, base_version=step - 1, version=step, level=args.level)
            enc = min(enc, time.process_time() - t0)
            work = {k: v.clone() for k, v in prev.items()}
            t0 = time.process_time()
            apply_delta(d.data, work)
            dec = min(dec, time.process_time() - t0)
        mem = memcpy_gbps(new, full, args.repeats)
        paper = d.changed * 10
        rows.append(dict(lr=lr, step=step, loss=loss.item(), sparsity=d.sparsity, delta_bytes=len(d.data),
                         full_bytes=full, over_full=len(d.data) / full, over_paper=len(d.data) / max(paper, 1),
                         paper_bytes=paper, encode_gbps=full / enc / 1e9, decode_gbps=full / dec / 1e9,
                         memcpy_gbps=mem))
        prev = new
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 steps per learning rate instead of 8")
    ap.add_argument("--model", help="a local transformers causal-LM directory (default: a small random Qwen2)")
    ap.add_argument("--hidden", type=int, default=768, help="hidden size of the built Qwen2 (no --model); 768 x 4 layers is 56 MB in bf16")
    ap.add_argument("--layers", type=int, default=4, help="layers of the built Qwen2 (no --model)")
    ap.add_argument("--lrs", type=float, nargs="+", default=list(LRS), help="learning rates (1e-6 is always run)")
    ap.add_argument("--level", type=int, default=1, help="zstd level")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (more than 1 lets OpenMP workers spin and inflate CPU-time figures)")
    ap.add_argument("--repeats", type=int, default=5, help="timing repeats per step (the best is kept)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    steps = 3 if args.quick else 8
    summary = {}
    print(f"{'lr':>7} {'step':>4} {'sparsity':>9} {'delta/full':>10} {'delta/paper':>11} "
          f"{'enc GB/s':>8} {'dec GB/s':>8} {'memcpy GB/s':>11}")
    for lr in sorted(set(args.lrs) | {1e-6}):
        rows = run_lr(lr, steps, args)
        for r in rows:
            print(f"{lr:7.0e} {r['step']:4d} {r['sparsity']:9.5f} {r['over_full']:10.5f} {r['over_paper']:11.4f} "
                  f"{r['encode_gbps']:8.3f} {r['decode_gbps']:8.3f} {r['memcpy_gbps']:11.3f}")
        med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
        summary[lr] = {k: med(k) for k in ("sparsity", "over_full", "over_paper", "encode_gbps", "decode_gbps",
                                           "memcpy_gbps", "delta_bytes", "paper_bytes")}
        summary[lr]["full_bytes"] = rows[0]["full_bytes"]
        summary[lr]["spread"] = {
            "sparsity": spread([r["sparsity"] for r in rows], 6),
            "delta_bytes_over_astraflow_format": spread([r["over_paper"] for r in rows]),
            "encode_over_memcpy": spread([r["encode_gbps"] / r["memcpy_gbps"] for r in rows]),
            "decode_over_memcpy": spread([r["decode_gbps"] / r["memcpy_gbps"] for r in rows])}
    print("\nmedian over steps, by learning rate (enc/memcpy, dec/memcpy: median of the steps' ratios [min, max])")
    print(f"{'lr':>7} {'sparsity':>9} {'delta/full':>10} {'delta/paper':>11} {'enc/memcpy':>20} {'dec/memcpy':>20}")
    for lr, s in summary.items():
        enc, dec = s["spread"]["encode_over_memcpy"], s["spread"]["decode_over_memcpy"]
        cells = ["{median:.3f} [{min:.3f}, {max:.3f}]".format(**x) for x in (enc, dec)]
        print(f"{lr:7.0e} {s['sparsity']:9.5f} {s['over_full']:10.5f} {s['over_paper']:11.4f} "
              f"{cells[0]:>20} {cells[1]:>20}")
    s = summary[1e-6]
    print(json.dumps({
        "metric": "weights_delta", "lr": 1e-6, "full_bytes": s["full_bytes"],
        "sparsity": round(s["sparsity"], 6),
        "delta_bytes_over_full": round(s["over_full"], 6),
        "delta_bytes_over_astraflow_format": round(s["over_paper"], 4),
        "encode_over_memcpy": s["spread"]["encode_over_memcpy"]["median"],
        "decode_over_memcpy": s["spread"]["decode_over_memcpy"]["median"],
        "value": s["delta_bytes"], "baseline": s["paper_bytes"],
        "ratio": round(s["delta_bytes"] / max(s["paper_bytes"], 1), 4), "steps": steps,
        "spread": s["spread"],
    }))


if __name__ == "__main__":
    main()

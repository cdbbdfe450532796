#!/usr/bin/env python
"""Benchmark the sparse bf16 weight delta on real optimizer steps.

A transformers causal LM (by default a small Qwen2 built locally with random
init; ``--model DIR`` loads one from disk) trains with AdamW on GSM8K text
(bytes as token ids) at learning rates 1e-7, 1e-6, 1e-5 and 1e-4. Master
weights are fp32 with a bf16 autocast forward, and what is published is the
bf16 cast, as a mixed-precision trainer would publish. After each step the
delta between consecutive bf16 versions is encoded and decoded
(:mod:`weights.codec`) twice, interleaved: in the previous format's coding
(gaps + raw values for every tensor, ``coding=("gaps", "raw")``) and in the
current one (each tensor's smallest coding). The script reports per step:

- sparsity: fraction of bf16 elements bit-identical to the previous version;
- delta bytes / full bf16 bytes, and bytes per changed element, of both;
- an entropy estimate in bytes per change: the changed positions as
  independent draws at the measured density, plus the empirical entropy of the
  changes as integer differences of the bit patterns;
- delta bytes / the paper's format (AstraFlow paper, "Weights"): a flat index
  plus the raw 2-byte value per changed element, uncompressed, the index a
  uint32 while the flat buffer has under 2^32 elements (6 bytes per change),
  else a uint64 (10 bytes);
- encode and decode GB/s (full bf16 bytes / seconds; decode includes the
  checksum verification), and memcpy GB/s of the same bytes, measured here.

Timings are CPU seconds of this process (``time.process_time``), best of
``--repeats``, for encode, decode and memcpy alike, so that other processes on
a shared machine do not skew the ratios; ``--show-repeats`` prints every one.
As a publisher and a puller do, the encoder and decoder are given the base's
checksum (computed outside the timings).

Ends with one JSON line for lr=1e-6 (medians over steps) about the current format.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from weights.codec import apply_delta, bits, encode_delta, state_sha256

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


def memcpy_seconds(src: list[np.ndarray], dst: list[np.ndarray]) -> float:
    """CPU seconds to copy every array of ``src`` into ``dst`` (preallocated and touched)."""
    t0 = time.process_time()
    for a, b in zip(src, dst):
        np.copyto(b, a)
    return time.process_time() - t0


def entropy_bytes_per_change(prev: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> float:
    """Bits per changed element / 8 of: positions as independent draws at the measured density, plus the
    empirical entropy of the changes as integer differences of the bit patterns (all tensors pooled)."""
    diffs, total = [], 0
    for k in prev:
        a, b = bits(prev[k]).astype(np.int64), bits(new[k]).astype(np.int64)
        changed = a != b
        diffs.append(b[changed] - a[changed])
        total += a.size
    d = np.concatenate(diffs)
    if not d.size:
        return 0.0
    p = d.size / total
    positions = (-(p * math.log2(p) + (1 - p) * math.log2(1 - p)) / p) if p < 1 else 0.0
    counts = np.unique(d, return_counts=True)[1] / d.size
    return (positions - float((counts * np.log2(counts)).sum())) / 8


#: The formats compared: the previous format's coding for every tensor, and the current choice.
FORMATS = {"previous": ("gaps", "raw"), "current": None}


def run_lr(lr: float, steps: int, args) -> list[dict]:
    model = build_model(args.model, args.hidden, args.layers)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    data = batches(model.config.vocab_size, args.batch, args.seq)
    prev = bf16_state(model)
    full = sum(v.numel() * v.element_size() for v in prev.values())
    elements = sum(v.numel() for v in prev.values())
    paper_index = 4 if elements < 2**32 else 8  # the paper's index width; values are bf16
    rows = []
    for step in range(1, steps + 1):
        x = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        new = bf16_state(model)
        base_sha = state_sha256(prev)
        src = [bits(v) for v in new.values()]
        dst = [np.empty_like(a) for a in src]
        memcpy_seconds(src, dst)  # touch the destination
        # best of `repeats` for encode, decode and memcpy alike (the machine may be shared); formats interleaved
        best = {(f, k): float("inf") for f in FORMATS for k in ("enc", "dec")}
        mem = float("inf")
        for rep in range(args.repeats):
            line = []
            for fmt, coding in FORMATS.items():
                t0 = time.process_time()
                d = encode_delta(prev, new, base_version=step - 1, version=step, level=args.level,
                                 base_sha256=base_sha, coding=coding)
                enc = time.process_time() - t0
                work = {k: v.clone() for k, v in prev.items()}
                t0 = time.process_time()
                apply_delta(d.data, work, base_sha256=base_sha)
                dec = time.process_time() - t0
                best[fmt, "enc"], best[fmt, "dec"] = min(best[fmt, "enc"], enc), min(best[fmt, "dec"], dec)
                best[fmt, "bytes"], best[fmt, "codings"] = len(d.data), d.codings
                line.append((fmt, enc, dec))
            m = memcpy_seconds(src, dst)
            mem = min(mem, m)
            if args.show_repeats:
                print(f"        lr {lr:.0e} step {step} repeat {rep + 1}: " + "; ".join(
                    f"{fmt} encode {m / enc:.3f}x decode {m / dec:.3f}x memcpy" for fmt, enc, dec in line))
        row = dict(lr=lr, step=step, loss=loss.item(), sparsity=d.sparsity, changed=d.changed, full_bytes=full,
                   paper_bytes=d.changed * (paper_index + 2), paper_index_bytes=paper_index, memcpy_gbps=full / mem / 1e9,
                   entropy_per_change=entropy_bytes_per_change(prev, new), codings=best["current", "codings"])
        for fmt in FORMATS:
            size = best[fmt, "bytes"]
            row.update({f"{fmt}_bytes": size, f"{fmt}_over_full": size / full,
                        f"{fmt}_over_paper": size / max(row["paper_bytes"], 1),
                        f"{fmt}_per_change": size / max(d.changed, 1),
                        f"{fmt}_encode_over_memcpy": mem / best[fmt, "enc"],
                        f"{fmt}_decode_over_memcpy": mem / best[fmt, "dec"]})
        rows.append(row)
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
    ap.add_argument("--show-repeats", action="store_true", help="print every repeat's timings")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    steps = 3 if args.quick else 8
    summary = {}
    keys = ("sparsity", "entropy_per_change", "paper_bytes") + tuple(
        f"{fmt}_{k}" for fmt in FORMATS for k in ("bytes", "over_full", "over_paper", "per_change",
                                                  "encode_over_memcpy", "decode_over_memcpy"))
    head = (f"{'lr':>7} {'step':>4} {'sparsity':>9} {'entropy B/chg':>13} | {'format':>8} {'B/change':>8} "
            f"{'delta/full':>10} {'delta/paper':>11} {'enc/memcpy':>10} {'dec/memcpy':>10}")
    print(head)
    for lr in sorted(set(args.lrs) | {1e-6}):
        rows = run_lr(lr, steps, args)
        for r in rows:
            for fmt in FORMATS:
                print(f"{lr:7.0e} {r['step']:4d} {r['sparsity']:9.5f} {r['entropy_per_change']:13.3f} | {fmt:>8} "
                      f"{r[fmt + '_per_change']:8.3f} {r[fmt + '_over_full']:10.5f} {r[fmt + '_over_paper']:11.4f} "
                      f"{r[fmt + '_encode_over_memcpy']:10.3f} {r[fmt + '_decode_over_memcpy']:10.3f}")
            print(f"{'':>7} codings of the current format (tensors): {r['codings']}")
        summary[lr] = {k: statistics.median(r[k] for r in rows) for k in keys}
        summary[lr]["full_bytes"], summary[lr]["paper_index_bytes"] = rows[0]["full_bytes"], rows[0]["paper_index_bytes"]
    index = "uint32" if summary[1e-6]["paper_index_bytes"] == 4 else "uint64"
    print(f"\nmedian over steps, by learning rate (the paper's format: a {index} index + the bf16 value per change)")
    print(head.replace(f"{'step':>4} ", ""))
    for lr, s in summary.items():
        for fmt in FORMATS:
            print(f"{lr:7.0e} {s['sparsity']:9.5f} {s['entropy_per_change']:13.3f} | {fmt:>8} {s[fmt + '_per_change']:8.3f} "
                  f"{s[fmt + '_over_full']:10.5f} {s[fmt + '_over_paper']:11.4f} "
                  f"{s[fmt + '_encode_over_memcpy']:10.3f} {s[fmt + '_decode_over_memcpy']:10.3f}")
    s = summary[1e-6]
    print(json.dumps({
        "metric": "weights_delta", "lr": 1e-6, "full_bytes": s["full_bytes"],
        "sparsity": round(s["sparsity"], 6), "paper_index_bytes": s["paper_index_bytes"],
        "delta_bytes_over_full": round(s["current_over_full"], 6),
        "delta_bytes_over_astraflow_format": round(s["current_over_paper"], 4),
        "bytes_per_change": round(s["current_per_change"], 4),
        "entropy_bytes_per_change": round(s["entropy_per_change"], 4),
        "previous_format_bytes_per_change": round(s["previous_per_change"], 4),
        "encode_over_memcpy": round(s["current_encode_over_memcpy"], 4),
        "decode_over_memcpy": round(s["current_decode_over_memcpy"], 4),
        "previous_format_encode_over_memcpy": round(s["previous_encode_over_memcpy"], 4),
        "previous_format_decode_over_memcpy": round(s["previous_decode_over_memcpy"], 4),
        "value": s["current_bytes"], "baseline": s["paper_bytes"],
        "ratio": round(s["current_bytes"] / max(s["paper_bytes"], 1), 4),
    }))


if __name__ == "__main__":
    main()

"""Peak memory of the trainer's teacher-forced logprobs, before and after the chunked log-softmax.

A random-init model of Qwen3-0.6B's shape (vocabulary 151,936, hidden 1,024, 16 heads, 8 KV heads, MLP 3,072;
``--layers`` of its 28 decoder layers, 2 by default: what is measured, the logprobs of the [B, T, V] logits, does
not depend on the depth) runs one training forward and backward on one sequence of ``--seq`` tokens (2,048) on the
CPU, under bf16 autocast over fp32 weights as the trainer does by default. Arms:

- ``before``: the plain computation trainer/model.py had (float32 copy of the logits, divided by the temperature,
  log-softmax and entropy over all of [B, T, V]; the trainer always asked for the entropy);
- ``after``: :func:`trainer.model.token_logprobs` with the entropy reported but unused (``entropy_coef: 0``);
- ``after_entropy_grad``: the same with the entropy in the loss (``entropy_coef > 0``).

Each measurement is a fresh process: the model is built, the peak RSS is reset (``/proc/self/clear_refs``), one
step runs, and the step's peak is VmHWM less the RSS before it. Arms are interleaved over ``--repeats`` rounds
(A B C, C B A, ...). Prints one line per measurement, then one JSON line: every repetition and its spread per arm
(peak MB, step seconds) and the ratio of the medians. One measurement costs ~65 s on 2 cores (the lm_head's
three 2,048 x 1,024 x 151,936 matmuls dominate), so the defaults (``before`` and ``after``, one round) take ~2.5
minutes; the peak is deterministic to ~1% across rounds.

    python scripts/bench_logprob_memory.py [--seq 2048] [--layers 2] [--repeats 1] [--arms before,after]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

ARMS = ("before", "after", "after_entropy_grad")
#: The loss's entropy coefficient in the arms that use the entropy (its value does not change the memory).
ENTROPY_COEF = 0.01


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def plain_token_logprobs(model, input_ids, attention_mask, temperature=1.0):
    """The logprobs and entropy as trainer/model.py computed them before the chunked log-softmax (the "before" arm)."""
    import torch

    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
    logits = logits.float() / temperature
    logz = torch.logsumexp(logits, dim=-1)
    tok = torch.gather(logits, -1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) - logz
    log_probs = logits - logz.unsqueeze(-1)
    ent = -(log_probs.exp() * log_probs).sum(-1)
    return torch.nn.functional.pad(tok, (1, 0)), torch.nn.functional.pad(ent, (1, 0))


def child(arm: str, seq: int, layers: int) -> dict:
    """One measurement of ``arm`` in this process: {"peak_mb": the step's peak RSS over the RSS before it,
    "step_s": seconds of the forward and backward}."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trainer.model import token_logprobs

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                         max_position_embeddings=40960)
    model = Qwen3ForCausalLM(config).float().eval()
    ids = torch.randint(0, config.vocab_size, (1, seq))
    mask = torch.ones_like(ids)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the RSS now
    base = _rss_kb("VmRSS")
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if arm == "before":
            logp, ent = plain_token_logprobs(model, ids, mask)
        else:
            logp, ent = token_logprobs(model, ids, mask, with_entropy=True)
    loss = -logp.mean() - (ENTROPY_COEF * ent.mean() if arm != "after" else 0.0)
    loss.backward()
    step_s = time.perf_counter() - t0
    return {"peak_mb": (_rss_kb("VmHWM") - base) / 1024, "step_s": step_s, "entropy": float(ent.mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=2048, help="tokens in the sequence")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (Qwen3-0.6B has 28)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds; each runs every arm once, interleaved")
    ap.add_argument("--arms", default="before,after", help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.seq, args.layers)))
        return
    from spread import interleaved, spread

    arms = [arm for arm in ARMS if arm in args.arms.split(",")]  # "before" first: the others' baseline
    if "before" not in arms or not set(args.arms.split(",")) <= set(ARMS):
        ap.error(f"--arms: 'before' and any of {', '.join(ARMS[1:])}")
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    for r, arm in interleaved(arms, args.repeats):
        out = subprocess.run([sys.executable, __file__, "--child", arm, "--seq", str(args.seq), "--layers",
                              str(args.layers)], capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            sys.exit(f"{arm} (round {r}) failed:\n{out.stderr[-3000:]}")
        m = json.loads(out.stdout.strip().splitlines()[-1])
        runs[arm].append(m)
        print(f"round {r} {arm:>20}: peak {m['peak_mb']:8.0f} MB  step {m['step_s']:6.2f} s", file=sys.stderr)
    result = {"bench": "logprob_memory", "seq": args.seq, "layers": args.layers, "vocab": 151936,
              "repeats": args.repeats}
    for arm in arms:
        result[arm] = {"peak_mb": spread([m["peak_mb"] for m in runs[arm]], 1),
                       "step_s": spread([m["step_s"] for m in runs[arm]], 2)}
    for arm in arms[1:]:
        before = result["before"]["peak_mb"]["median"]
        result[f"{arm}_peak_over_before"] = round(result[arm]["peak_mb"]["median"] / before, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

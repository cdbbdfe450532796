#!/usr/bin/env python
"""The steps of ``scripts/gpu_check.sh`` (one step per process, so that each is bounded by ``timeout``).

Usage: ``scripts/gpu_check.py STEP --out DIR --work DIR [--device cuda|cpu] [--small] [--timeout S]``
with STEP one of ``env``, ``build``, ``engine``, ``trainer``, ``bench``, ``vllm``, ``sglang``.

Each step writes ``OUT/STEP.json`` (one JSON line: step, status PASS/FAIL/SKIP, reason, seconds and
its metrics) and ``OUT/STEP.status`` (``STATUS<TAB>reason``, read by the shell script). A step SKIPs
when it cannot run here (no CUDA, a Python module not installed, no model because the build did not
pass, vLLM/SGLang absent) and FAILs when it ran and something was wrong. Nothing is downloaded: the
model is a random-init Qwen2 built from a config (``build``), saved under ``WORK/model``.

Sizes: by default the Qwen2-0.5B shape (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, vocab
151936, tied embeddings: 494M parameters); ``--small`` a 2-layer hidden-128 model (head dim 64, as in the
0.5B shape; vLLM's CPU attention refuses 16) with vocab 1024 for a quick CPU dry run. The tokenizer is
the tiny model's character tokenizer (``scripts/make_tiny_model.py``: its specials and ASCII characters
keep their ids) with its vocabulary padded by filler tokens (``<|fill_N|>``) up to the model's
vocabulary, so every id the random model samples decodes.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: top-level packages of this repository: a missing one is a bug (FAIL), not a missing install (SKIP)
PROJECT = {"trainer", "producers", "weights", "topics", "policies", "astraflow", "consumers"}

QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                 rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
SIZES = {
    "full": dict(model=QWEN2_05B, prompts=16, samples=16, new_tokens=64, groups=8, group_size=8, micro=16,
                 steps=3, params=(4.5e8, 5.5e8)),
    "small": dict(model=dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                             rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
                  prompts=4, samples=4, new_tokens=8, groups=2, group_size=4, micro=4, steps=2,
                  params=(5e4, 5e5)),
}
VERSIONS = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "pydantic", "msgpack", "zstandard",
            "xxhash", "httpx", "accelerate", "deepspeed", "flash_attn", "vllm", "sglang")


class Skip(Exception):
    """The step cannot run here; the message says why."""


class Ctx:
    """What a step knows: arguments, sizes, deadline, and the metrics it has gathered so far."""

    def __init__(self, args: argparse.Namespace):
        self.step, self.out, self.work = args.step, Path(args.out), Path(args.work)
        self.device, self.small = args.device, args.small
        self.size = SIZES["small" if args.small else "full"]
        self.deadline = time.monotonic() + args.timeout
        self.model_dir = self.work / "model"
        self.metrics: dict = {}

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def left(self) -> float:
        """Seconds left before this step's timeout."""
        return self.deadline - time.monotonic()


def log(msg: str) -> None:
    print(f"  {msg}", flush=True)


# -- helpers ---------------------------------------------------------------------------------------
def need_torch_device(ctx: Ctx):
    """torch, with the requested device usable (else Skip)."""
    import torch

    if ctx.cuda and not torch.cuda.is_available():
        raise Skip(f"torch.cuda.is_available() is False (torch {torch.__version__}, "
                   f"built for CUDA {torch.version.cuda}); GPU_CHECK_DEVICE=cpu runs the steps on the CPU")
    return torch


def need_model(ctx: Ctx) -> Path:
    if not (ctx.model_dir / "config.json").is_file():
        raise Skip(f"no model at {ctx.model_dir}: the build step did not pass")
    return ctx.model_dir


def sync(ctx: Ctx) -> None:
    import torch

    if ctx.cuda:
        torch.cuda.synchronize()


def gpu_mem(ctx: Ctx) -> None:
    """Record the peak CUDA memory of this process (GiB)."""
    import torch

    if ctx.cuda:
        ctx.metrics["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)


def load_tiny_script():
    """``scripts/make_tiny_model.py`` as a module (for its tokenizer's pieces)."""
    spec = importlib.util.spec_from_file_location("make_tiny_model", ROOT / "scripts" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_tokenizer(vocab_size: int):
    """The tiny model's character tokenizer (same ids for its specials and characters) padded with
    ``<|fill_N|>`` tokens to ``vocab_size`` entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tiny = load_tiny_script()
    chars = [tiny._byte_level(c) for c in ["\n"] + [chr(c) for c in range(32, 127)]]
    pieces = list(tiny.SPECIALS) + chars
    if vocab_size < len(pieces):
        raise ValueError(f"vocab_size {vocab_size} < the tiny tokenizer's {len(pieces)}")
    pieces += [f"<|fill_{i}|>" for i in range(len(pieces), vocab_size)]
    vocab = {tok: i for i, tok in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(tiny.SPECIALS))
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)
    fast.chat_template = tiny.CHAT_TEMPLATE
    return fast


def prompts_for(tok, n: int) -> list[list[int]]:
    """``n`` distinct prompts of varied length (so left padding is exercised)."""
    rng = random.Random(0)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        out.append(tok.encode(f"Question {i}: what is {a} + {b}?" + " Think step by step." * (i % 3)))
    return out


def rollout(ctx: Ctx, engine, prompts: list[list[int]], what: str) -> list:
    """Warm up, then time ``samples`` continuations of ``new_tokens`` tokens for each prompt; check them and
    record tokens/s in ``ctx.metrics``."""
    import numpy as np

    from producers.engines import SamplingParams

    g, t = ctx.size["samples"], ctx.size["new_tokens"]
    batch = [p for p in prompts for _ in range(g)]
    engine.generate(batch[:g], SamplingParams(max_new_tokens=4, stop_token_ids=(), seed=123))  # warm-up
    sync(ctx)
    start = time.perf_counter()
    # unseeded, as RaaS samples: VLLMEngine sends one seed with every request, so a seeded group's samples are equal
    gens = engine.generate(batch, SamplingParams(max_new_tokens=t, temperature=1.0, stop_token_ids=()))
    sync(ctx)
    seconds = time.perf_counter() - start
    tokens = sum(len(x.output_ids) for x in gens)
    ctx.metrics.update(prompts=len(prompts), samples_per_prompt=g, new_tokens=t, gen_s=round(seconds, 3),
                       gen_tokens=tokens, tokens_per_s=round(tokens / seconds, 1))
    log(f"{what}: {len(batch)} sequences x {t} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tokens/s")
    assert len(gens) == len(batch), f"{len(gens)} generations for {len(batch)} prompts"
    bad = [i for i, x in enumerate(gens) if len(x.output_ids) != t or len(x.logprobs) != t]
    assert not bad, f"{len(bad)} generations are not {t} tokens long (stop_token_ids=() asks for exactly {t})"
    lp = np.concatenate([x.logprobs for x in gens])
    assert np.isfinite(lp).all() and (lp <= 1e-3).all(), f"logprobs not finite or > 0: min {lp.min()}, max {lp.max()}"
    ctx.metrics["mean_logprob"] = round(float(lp.mean()), 4)
    for i in range(len(prompts)):  # the samples of a prompt should differ (temperature 1, random model)
        rows = {tuple(x.output_ids.tolist()) for x in gens[i * g:(i + 1) * g]}
        assert g == 1 or len(rows) > 1, f"all {g} samples of prompt {i} are identical"
    return gens


def logprob_error(ctx: Ctx, model, prompts: list[list[int]], gens: list, rows: int = 8) -> float:
    """Mean |engine logprob - teacher-forced recompute (trainer.model.token_logprobs, T=1)| over ``rows``
    sequences, one per prompt first."""
    import numpy as np
    import torch

    from trainer.model import token_logprobs

    g = ctx.size["samples"]
    picks = [i * g for i in range(len(prompts))][:rows]
    diffs = []
    dev = next(model.parameters()).device
    with torch.inference_mode():
        for i in picks:
            p = prompts[i // g]
            ids = torch.tensor([p + gens[i].output_ids.tolist()], device=dev)
            logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
            diffs.append(np.abs(logp[0, len(p):].float().cpu().numpy() - gens[i].logprobs))
    return float(np.concatenate(diffs).mean())


# -- steps -----------------------------------------------------------------------------------------
def step_env(ctx: Ctx) -> str:
    """Interpreter, packages, torch/CUDA, the GPU (nvidia-smi), CPU, memory and disk."""
    from importlib import metadata

    m = ctx.metrics
    m["python"] = sys.executable
    m["python_version"] = platform.python_version()
    m["cpus"] = os.cpu_count()
    try:
        m["mem_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    m["work_disk_free_gib"] = round(shutil.disk_usage(ctx.work).free / 2**30, 1)
    versions = {}
    for name in VERSIONS:
        try:
            versions[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            versions[name] = None
    m["packages"] = versions
    log(f"python {m['python_version']} at {sys.executable}; {m['cpus']} CPUs, {m.get('mem_gib')} GiB, "
        f"{m['work_disk_free_gib']} GiB free under {ctx.work}")
    log("packages: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            q = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
            m["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()[:300]
            full = subprocess.run([smi], capture_output=True, text=True, timeout=30)
            (ctx.out / "nvidia-smi.txt").write_text(full.stdout + full.stderr)
        except subprocess.TimeoutExpired:
            m["nvidia_smi"] = "nvidia-smi timed out"
    else:
        m["nvidia_smi"] = None
    log(f"nvidia-smi: {m['nvidia_smi']}")
    missing = [k for k in ("torch", "transformers", "tokenizers", "numpy", "pydantic") if versions[k] is None]
    if "torch" in missing:
        m["usable"] = False
        return f"torch is not installed for {sys.executable}: the GPU steps will SKIP"
    import torch

    m["torch"] = torch.__version__
    m["torch_cuda_build"] = torch.version.cuda
    m["cuda_available"] = torch.cuda.is_available()
    log(f"torch {torch.__version__} (CUDA build {torch.version.cuda}); torch.cuda.is_available() = "
        f"{m['cuda_available']}")
    if m["cuda_available"]:
        m["device_count"] = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        m["gpu"] = props.name
        m["gpu_mem_gib"] = round(props.total_memory / 2**30, 1)
        m["capability"] = f"{props.major}.{props.minor}"
        m["bf16"] = torch.cuda.is_bf16_supported()
        x = torch.randn(1024, 1024, device="cuda")
        assert torch.isfinite(x @ x).all(), "a 1024x1024 matmul on the GPU is not finite"
        log(f"GPU 0: {m['gpu']}, {m['gpu_mem_gib']} GiB, capability {m['capability']}, bf16 {m['bf16']}")
    m["usable"] = not missing and (m["cuda_available"] or not ctx.cuda)
    notes = []
    if missing:
        notes.append(f"missing Python packages {missing}: steps needing them will SKIP")
    if ctx.cuda and not m["cuda_available"]:
        notes.append("no CUDA device usable by torch: the GPU steps will SKIP")
    return "; ".join(notes)


def step_build(ctx: Ctx) -> str:
    """A random-init Qwen2 of the chosen size, saved in bf16 with the padded tiny tokenizer."""
    torch = need_torch_device(ctx)
    from transformers import AutoModelForCausalLM, Qwen2Config

    shape = ctx.size["model"]
    start = time.perf_counter()
    tok = build_tokenizer(shape["vocab_size"])
    config = Qwen2Config(**shape, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    lo, hi = ctx.size["params"]
    assert lo <= params <= hi, f"{params:,} parameters, expected {lo:,.0f}..{hi:,.0f}"
    model = model.to(torch.bfloat16)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    tmp = ctx.work / "model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, ctx.model_dir)
    seconds = time.perf_counter() - start
    size = sum(f.stat().st_size for f in ctx.model_dir.iterdir())
    from transformers import AutoTokenizer

    back = AutoTokenizer.from_pretrained(ctx.model_dir)
    assert len(back) == shape["vocab_size"], f"tokenizer reloads with {len(back)} tokens"
    assert back.decode(back.encode("12+7=", add_special_tokens=False)) == "12+7="
    ctx.metrics.update(params=params, dir_bytes=size, build_s=round(seconds, 1),
                       **{k: shape[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")})
    log(f"Qwen2 {params / 1e6:.1f}M parameters, {size / 2**20:.0f} MiB in bf16 at {ctx.model_dir} ({seconds:.1f} s)")
    return (f"{params / 1e6:.1f}M-parameter random Qwen2 in bf16; tokenizer = the tiny character tokenizer "
            f"padded to vocab {shape['vocab_size']}")


def step_engine(ctx: Ctx) -> str:
    """HFEngine on the device: prompts x samples x new_tokens, tokens/s, logprobs vs a recompute, an update."""
    torch = need_torch_device(ctx)
    import numpy as np

    from producers.hf_engine import HFEngine

    model_dir = need_model(ctx)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    start = time.perf_counter()
    eng = HFEngine(model_dir, device=ctx.device, dtype=dtype, max_batch=256)
    ctx.metrics["load_s"] = round(time.perf_counter() - start, 2)
    prompts = prompts_for(eng.tokenizer, ctx.size["prompts"])
    gens = rollout(ctx, eng, prompts, "HFEngine")
    err = logprob_error(ctx, eng.model, prompts, gens)
    ctx.metrics["logprob_mae_vs_recompute"] = float(f"{err:.3g}")
    log(f"mean |engine logprob - teacher-forced recompute| = {err:.2e}")
    assert err < (0.1 if dtype == torch.bfloat16 else 1e-3), f"logprobs differ from the recompute by {err:.3g}"
    # the rollouts, for the trainer step (on-policy groups)
    g = ctx.size["samples"]
    np.savez(ctx.work / "rollouts.npz", prompt_flat=np.concatenate(prompts).astype(np.int32),
             prompt_len=np.array([len(p) for p in prompts]), samples=g,
             out=np.stack([x.output_ids for x in gens]), logp=np.stack([x.logprobs for x in gens]))
    # a weight update: version moves and outputs change
    name = "model.norm.weight"
    before = eng.generate(prompts[:1], _sp(8, seed=5))[0].output_ids
    eng.load_weights({name: eng.model.state_dict()[name] * -3.0}, version=1)
    after = eng.generate(prompts[:1], _sp(8, seed=5))[0]
    assert eng.version == 1 and after.version == 1, "load_weights did not move the version"
    assert not np.array_equal(before, after.output_ids), "greedy outputs did not change after load_weights"
    gpu_mem(ctx)
    return f"{ctx.metrics['tokens_per_s']:,.0f} tokens/s ({ctx.metrics['gen_tokens']} tokens, {ctx.device})"


def _sp(n: int, seed: int):
    from producers.engines import SamplingParams

    return SamplingParams(max_new_tokens=n, temperature=0.0, stop_token_ids=(), seed=seed)


def make_groups(ctx: Ctx, trainer, tokenizer) -> tuple[list, str]:
    """GRPO groups: the engine step's rollouts when present (on-policy), else random continuations with the
    trainer's own logprobs. Rewards: the fraction of even token ids in each continuation (varies in a group)."""
    import uuid

    import numpy as np
    import torch

    from topics.schemas import Sample, TrajectoryGroup
    from trainer.model import token_logprobs

    n_groups, gsize = ctx.size["groups"], ctx.size["group_size"]
    path = ctx.work / "rollouts.npz"
    seqs = []  # (prompt ids, output ids, behaviour logprobs)
    if path.is_file():
        r = np.load(path)
        ends = np.cumsum(r["prompt_len"])
        prompts = np.split(r["prompt_flat"], ends[:-1])
        g = int(r["samples"])
        if len(prompts) >= n_groups and g >= gsize:
            for i in range(n_groups):
                for j in range(gsize):
                    seqs.append((prompts[i], r["out"][i * g + j], r["logp"][i * g + j]))
            source = "the engine step's rollouts"
    if not seqs:
        source = "random continuations scored by the trainer's model (no engine rollouts)"
        rng = np.random.default_rng(0)
        vocab = trainer.model.config.vocab_size
        for p in prompts_for(tokenizer, n_groups):
            for _ in range(gsize):
                out = rng.integers(0, vocab, ctx.size["new_tokens"]).astype(np.int32)
                ids = torch.tensor([list(p) + out.tolist()], device=trainer.device)
                with torch.no_grad(), trainer._autocast():
                    logp, _ = token_logprobs(trainer.model, ids, torch.ones_like(ids))
                seqs.append((np.array(p, np.int32), out, logp[0, len(p):].float().cpu().numpy()))
    groups = []
    for i in range(n_groups):
        samples = []
        for p, out, lp in seqs[i * gsize:(i + 1) * gsize]:
            n_p, n_o = len(p), len(out)
            samples.append(Sample(
                input_ids=np.concatenate([p, out]).astype(np.int32),
                loss_mask=np.r_[np.zeros(n_p), np.ones(n_o)].astype(np.uint8),
                behavior_logprobs=np.r_[np.zeros(n_p), lp].astype(np.float32),
                versions=np.r_[np.full(n_p, -1), np.zeros(n_o)].astype(np.int32),
                reward=float(np.mean(out % 2 == 0)), finish_reason="length"))
        groups.append(TrajectoryGroup.build(samples=samples, prompt_id=f"q{i}", group_id=uuid.uuid4().hex,
                                            policy="gpu-check"))
    return groups, source


def step_trainer(ctx: Ctx) -> str:
    """trainer.loop.Trainer on the device: a few GRPO steps (TIS, fp32 master weights, bf16 compute)."""
    torch = need_torch_device(ctx)
    import math

    from transformers import AutoTokenizer

    from trainer.config import TrainerConfig
    from trainer.loop import Trainer

    model_dir = need_model(ctx)
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = TrainerConfig(policy="gpu-check", device=ctx.device, param_dtype="bfloat16", master_dtype="float32", lr=1e-5,
                        correction="tis", micro_batch_size=ctx.size["micro"], pad_token_id=tok.pad_token_id, seed=0)
    start = time.perf_counter()
    trainer = Trainer(cfg, model_dir)
    ctx.metrics["load_s"] = round(time.perf_counter() - start, 2)
    groups, source = make_groups(ctx, trainer, tok)
    log(f"{len(groups)} groups x {len(groups[0].samples)} samples from {source}")
    master0 = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    pub0 = trainer.publish_state()
    steps = []
    for i in range(ctx.size["steps"]):
        m = trainer.train_step(groups).metrics
        sync(ctx)
        steps.append(m)
        log(f"step {i + 1}: loss {m['loss']:+.5f}  grad_norm {m['grad_norm']:.4f}  is_ratio_mean "
            f"{m['is_ratio_mean']:.4f}  {m['step_s']:.2f} s  {m['tokens_per_s']:,.0f} tokens/s")
        ctx.metrics["step_s"] = [round(x["step_s"], 3) for x in steps]
        ctx.metrics["loss"] = [round(x["loss"], 6) for x in steps]
    ctx.metrics.update(
        samples=int(steps[0]["samples"]), gen_tokens=int(steps[0]["tokens"]),
        step_s_median_after_first=round(statistics.median(x["step_s"] for x in steps[1:] or steps), 3),
        tokens_per_s_last=round(steps[-1]["tokens_per_s"], 1), grad_norm=[round(x["grad_norm"], 4) for x in steps],
        is_ratio_mean_first=round(steps[0]["is_ratio_mean"], 4), group_source=source)
    bad = [i + 1 for i, x in enumerate(steps) if not (math.isfinite(x["loss"]) and math.isfinite(x["grad_norm"]))]
    assert not bad, f"loss or grad_norm not finite at steps {bad}"
    assert all(x["grad_norm"] > 0 for x in steps), "a zero gradient"
    assert trainer.version == len(steps), f"version {trainer.version} after {len(steps)} steps"
    changed = total = 0
    for k, v in trainer.model.named_parameters():
        changed += int((v.detach() != master0[k]).sum())
        total += v.numel()
    ctx.metrics["master_changed_frac"] = round(changed / total, 4)
    assert changed > 0, "no parameter changed"
    pub = trainer.publish_state()
    pub_changed = sum(int((pub[k] != pub0[k]).sum()) for k in pub)
    ctx.metrics["published_bf16_changed_frac"] = round(pub_changed / sum(v.numel() for v in pub.values()), 5)
    log(f"changed: {changed / total:.2%} of fp32 master elements, "
        f"{ctx.metrics['published_bf16_changed_frac']:.3%} of published bf16 elements")
    gpu_mem(ctx)
    try:  # the weights path on the trained weights: encode the bf16 delta and apply it back, bit-exact
        from weights.codec import apply_delta, encode_delta

        t0 = time.perf_counter()
        d = encode_delta(pub0, pub, base_version=0, version=trainer.version)
        work = {k: v.clone() for k, v in pub0.items()}
        apply_delta(d.data, work)
        assert all(torch.equal(work[k].view(torch.int16), pub[k].view(torch.int16)) for k in pub), \
            "the decoded delta does not reproduce the published weights"
        ctx.metrics.update(delta_sparsity=round(d.sparsity, 6), delta_bytes=len(d.data),
                           delta_roundtrip_s=round(time.perf_counter() - t0, 2))
        log(f"bf16 delta v0->v{trainer.version}: sparsity {d.sparsity:.5f}, {len(d.data):,} bytes, applied bit-exact")
    except ModuleNotFoundError as e:
        ctx.metrics["delta"] = f"skipped: module {e.name} not installed"
    return (f"{len(steps)} GRPO steps, median step {ctx.metrics['step_s_median_after_first']} s, loss finite, "
            f"{changed / total:.1%} of master weights changed")


BENCH_SHIM = """
import importlib.util, sys
from pathlib import Path
script, data = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location("bench_weights", script)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.DATA = Path(data)  # the GSM8K file is absent here: synthetic text of the same shape
sys.argv = [script] + sys.argv[3:]
module.main()
"""


def step_bench(ctx: Ctx) -> str:
    """scripts/bench_weights.py as it is, on the built model (--model), quick, lr 1e-6 only."""
    need_model(ctx)
    script = ROOT / "scripts" / "bench_weights.py"
    src = script.read_text()
    for flag in ("--model", "--quick", "--lrs", "--repeats", "--threads"):
        if f'"{flag}"' not in src:
            raise Skip(f"scripts/bench_weights.py has no {flag} flag")
    spec = importlib.util.spec_from_file_location("bench_weights", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # raises ModuleNotFoundError (SKIP) when weights.codec's deps are missing
    threads = min(16, os.cpu_count() or 1) if not ctx.small else 1
    argv = ["--model", str(ctx.model_dir), "--quick", "--lrs", "1e-6", "--repeats", "2", "--threads", str(threads)]
    data = Path(module.DATA)
    if data.is_file() and not os.environ.get("GPU_CHECK_BENCH_SYNTHETIC"):
        cmd, ctx.metrics["data"] = [sys.executable, str(script), *argv], str(data)
    else:
        synth = ctx.work / "gsm8k_synthetic.jsonl"
        rng = random.Random(0)
        with open(synth, "w") as f:
            for _ in range(2000):
                a, b = rng.randint(1, 999), rng.randint(1, 999)
                f.write(json.dumps({"question": f"Natalia sold {a} clips in April and {b} in May. How many in all?",
                                    "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"}) + "\n")
        cmd = [sys.executable, "-c", BENCH_SHIM, str(script), str(synth), *argv]
        ctx.metrics["data"] = ("synthetic (GPU_CHECK_BENCH_SYNTHETIC is set)" if data.is_file()
                               else f"synthetic ({data} is absent here)")
    log(f"bench_weights {' '.join(argv)} (CPU, {threads} threads; data: {ctx.metrics['data']})")
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")  # idle OpenMP workers must not spin into CPU-time figures
    budget = max(10.0, ctx.left() - 10)
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=budget)
    except subprocess.TimeoutExpired as e:
        (ctx.out / "bench_weights.txt").write_text((e.stdout or b"").decode() if isinstance(e.stdout, bytes)
                                                  else (e.stdout or ""))
        raise AssertionError(f"bench_weights did not finish within {budget:.0f} s") from None
    (ctx.out / "bench_weights.txt").write_text(done.stdout + done.stderr)
    for line in done.stdout.splitlines():
        print("    " + line, flush=True)
    ctx.metrics["bench_s"] = round(time.perf_counter() - start, 1)
    assert done.returncode == 0, f"bench_weights exited {done.returncode}: {done.stderr.strip()[-400:]}"
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    assert lines, "bench_weights printed no JSON line"
    res = json.loads(lines[-1])
    for k in ("full_bytes", "sparsity", "delta_bytes_over_full", "delta_bytes_over_astraflow_format",
              "encode_over_memcpy", "decode_over_memcpy"):
        ctx.metrics[k] = res.get(k)
    assert 0.0 <= res["sparsity"] <= 1.0, f"sparsity {res['sparsity']}"
    return (f"lr 1e-6: sparsity {res['sparsity']:.4f}, delta/full {res['delta_bytes_over_full']:.4f} of "
            f"{res['full_bytes'] / 2**20:.1f} MiB (CPU benchmark)")


PROBE = """
import json, sys
out = {"python": sys.executable}
try:
    import torch
    out["torch"], out["cuda"] = torch.__version__, torch.cuda.is_available()
except Exception as e:
    out["torch_error"] = repr(e)[:200]
try:
    import importlib
    m = importlib.import_module(sys.argv[1])
    out["version"] = getattr(m, "__version__", "?")
    if sys.argv[1] == "vllm":
        from vllm.platforms import current_platform
        out["platform"] = str(current_platform.device_type)
except Exception as e:
    out["error"] = repr(e)[:300]
print(json.dumps(out))
"""


def find_python_with(module: str, candidates: list, ctx: Ctx) -> tuple[str, dict]:
    """The first candidate interpreter that imports ``module`` (Skip naming every try when none does)."""
    tried, seen = [], set()
    for c in candidates:
        if not c:
            continue
        path = shutil.which(str(c)) if not os.path.isabs(str(c)) else (str(c) if os.access(c, os.X_OK) else None)
        if path is None:
            tried.append(f"{c}: absent")
            continue
        if path in seen:
            continue
        seen.add(path)
        try:
            done = subprocess.run([path, "-c", PROBE, module], capture_output=True, text=True,
                                  timeout=max(5.0, min(120.0, ctx.left() - 30)))
            info = json.loads(done.stdout.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
            tried.append(f"{path}: probe failed ({type(e).__name__})")
            continue
        if "error" in info or "version" not in info:
            tried.append(f"{path}: import {module} fails ({info.get('error', '?')[:120]})")
            continue
        log(f"{module} {info['version']} at {path} (torch {info.get('torch')}, cuda {info.get('cuda')}, "
            f"platform {info.get('platform', '-')})")
        return path, info
    raise Skip(f"no Python here imports {module}: " + "; ".join(tried))


def step_vllm(ctx: Ctx) -> str:
    """The vLLM path (producers.vllm_server.VLLMServer + producers.vllm_engine.VLLMEngine) where vLLM runs."""
    if not ctx.cuda and not os.environ.get("GPU_CHECK_VLLM"):
        raise Skip("CPU dry run: vLLM's CPU server takes minutes to start; GPU_CHECK_VLLM=1 runs it anyway")
    need_torch_device(ctx)
    model_dir = need_model(ctx)
    python, info = find_python_with(
        "vllm", [os.environ.get("GPU_CHECK_VLLM_PYTHON"), ROOT / ".venv-vllm" / "bin" / "python", sys.executable], ctx)
    ctx.metrics.update(vllm=info["version"], vllm_python=python, vllm_platform=info.get("platform"))
    if ctx.cuda and (info.get("platform") != "cuda" or not info.get("cuda")):
        raise Skip(f"vLLM {info['version']} at {python} is not a CUDA build (platform {info.get('platform')}, "
                   f"torch.cuda.is_available() {info.get('cuda')})")
    from producers.vllm_engine import VLLMEngine
    from producers.vllm_server import VLLMServer
    from trainer.model import load_causal_lm

    extra = ["--gpu-memory-utilization", "0.3", "--max-num-seqs", "256"] if ctx.cuda else []
    dtype = "bfloat16" if ctx.cuda else "float32"
    with VLLMServer(model_dir, ctx.out / "vllm_server.log", dtype=dtype, max_model_len=512, python=python,
                    extra=extra) as server:
        waited = server.wait_healthy(timeout_s=max(10.0, ctx.left() - 60))
        ctx.metrics["startup_s"] = round(waited, 1)
        log(f"vLLM server healthy after {waited:.0f} s")
        eng = VLLMEngine(server.url, model_dir, startup_timeout_s=30, request_timeout_s=max(10.0, ctx.left() - 20))
        try:
            prompts = prompts_for(eng.tokenizer, ctx.size["prompts"])
            gens = rollout(ctx, eng, prompts, "vLLM")
        finally:
            eng.close()
    ref = load_causal_lm(model_dir, dtype, ctx.device, trainable=False)
    err = logprob_error(ctx, ref, prompts, gens)
    ctx.metrics["logprob_mae_vs_recompute"] = float(f"{err:.3g}")
    log(f"mean |vLLM logprob - trainer recompute| = {err:.2e}")
    assert err < (0.1 if ctx.cuda else 1e-3), f"vLLM logprobs differ from the trainer's recompute by {err:.3g}"
    return f"vLLM {info['version']}: {ctx.metrics['tokens_per_s']:,.0f} tokens/s"


def step_sglang(ctx: Ctx) -> str:
    """The SGLang path (producers.sglang_engine.SGLangEngine launching a server) where SGLang is installed."""
    if not ctx.cuda:
        raise Skip("CPU dry run: SGLang serves on CUDA only")
    need_torch_device(ctx)
    model_dir = need_model(ctx)
    python, info = find_python_with("sglang", [os.environ.get("GPU_CHECK_SGLANG_PYTHON"), sys.executable], ctx)
    ctx.metrics.update(sglang=info["version"], sglang_python=python)
    import numpy as np

    from producers.sglang_engine import SGLangEngine
    from trainer.model import load_causal_lm

    start = time.perf_counter()
    eng = SGLangEngine(model_dir, launch_args=("--mem-fraction-static", "0.3", "--dtype", "bfloat16"),
                       startup_timeout_s=max(10.0, ctx.left() - 60), timeout_s=max(10.0, ctx.left() - 20),
                       launcher=(python, "-m", "sglang.launch_server"))
    try:
        ctx.metrics["startup_s"] = round(time.perf_counter() - start, 1)
        prompts = prompts_for(eng.tokenizer, ctx.size["prompts"])
        gens = rollout(ctx, eng, prompts, "SGLang")
        ref = load_causal_lm(model_dir, "bfloat16", ctx.device, trainable=False)
        err = logprob_error(ctx, ref, prompts, gens)
        ctx.metrics["logprob_mae_vs_recompute"] = float(f"{err:.3g}")
        log(f"mean |SGLang logprob - trainer recompute| = {err:.2e}")
        assert err < 0.1, f"SGLang logprobs differ from the trainer's recompute by {err:.3g}"
        name = "model.norm.weight"
        before = eng.generate(prompts[:1], _sp(8, seed=5))[0].output_ids
        eng.load_weights({name: ref.state_dict()[name] * -3.0}, version=1)
        after = eng.generate(prompts[:1], _sp(8, seed=5))[0]
        assert eng.version == 1, "load_weights did not move the version"
        assert not np.array_equal(before, after.output_ids), "greedy outputs did not change after load_weights"
    finally:
        eng.close()
    return f"SGLang {info['version']}: {ctx.metrics['tokens_per_s']:,.0f} tokens/s"


def step_ranks(ctx: Ctx) -> str:
    """``trainer.ranks`` on the lent GPUs: 3 steps of fixed batches (``tests/trainer/dist_worker.py``, float32)
    on one rank, and with 2 or more GPUs on 2 ranks under torchrun, FSDP2 over nccl and (where deepspeed
    imports) DeepSpeed ZeRO-2; each 2-rank run must publish every version once and end within float32 rounding
    of the 1-rank weights (attention key biases, whose gradient is rounding noise, left out)."""
    torch = need_torch_device(ctx)
    model_dir = need_model(ctx)
    gpus = torch.cuda.device_count() if ctx.cuda else 2
    worker = ROOT / "tests" / "trainer" / "dist_worker.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def train(ranks: int, backend: str) -> tuple[dict, float]:
        out = ctx.work / f"ranks-{ranks}-{backend}.pt"
        args = [str(worker), str(model_dir), str(out), str(ranks), backend]
        cmd = ([sys.executable, *args] if ranks == 1 else
               [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), *args])
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(30, ctx.left() - 15))
        assert done.returncode == 0, (f"{ranks} rank(s), backend {backend}: exit {done.returncode}: "
                                      f"{(done.stdout + done.stderr)[-1500:]}")
        return torch.load(out, weights_only=False), time.perf_counter() - t0

    one, seconds = train(1, "torch")
    from trainer.model import load_causal_lm

    init = load_causal_lm(model_dir, "float32").state_dict()
    moved = max(float((one["weights"][k] - init[k]).abs().max()) for k in init)
    ctx.metrics["one_rank_s"], ctx.metrics["moved"] = round(seconds, 1), moved
    log(f"1 rank: {seconds:.1f} s, published {one['published']}, weights moved by up to {moved:.2e}")
    assert moved > 1e-4, f"3 steps at lr 1e-3 moved no weight by more than {moved:.2e}"
    if gpus < 2:
        return f"1 GPU: 1 rank trained and published {one['published']} in {seconds:.0f} s (2 ranks need 2 GPUs)"
    done = []
    for backend in ("torch", "deepspeed"):
        if backend == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
            log("deepspeed does not import here: ZeRO-2 not run")
            continue
        two, seconds = train(2, backend)
        assert two["published"] == [1, 2, 3], f"{backend}: published {two['published']}"
        gap = max(float((one["weights"][k] - two["weights"][k]).abs().max())
                  for k in one["weights"] if not k.endswith(".self_attn.k_proj.bias"))
        ctx.metrics[f"two_ranks_{backend}_s"], ctx.metrics[f"two_ranks_{backend}_max_gap"] = round(seconds, 1), gap
        log(f"2 ranks {backend}: {seconds:.1f} s, max |w2 - w1| {gap:.2e}")
        assert gap <= 1e-4, f"{backend} on 2 ranks ends {gap:.2e} from 1 rank (bound 1e-4)"
        done.append(f"{'FSDP2' if backend == 'torch' else 'ZeRO-2'} {gap:.1e}")
    return f"2 ranks match 1 within float32 rounding ({', '.join(done)})"


STEPS = {"env": step_env, "build": step_build, "engine": step_engine, "trainer": step_trainer, "ranks": step_ranks,
         "bench": step_bench, "vllm": step_vllm, "sglang": step_sglang}


def _on_term(signum, frame):
    raise SystemExit(f"stopped by signal {signum} (the step's timeout)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("step", choices=sorted(STEPS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _on_term)  # finally blocks (servers' stop) run when `timeout` fires
    ctx = Ctx(args)
    ctx.out.mkdir(parents=True, exist_ok=True)
    ctx.work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        reason, status = STEPS[args.step](ctx) or "", "PASS"
    except Skip as e:
        status, reason = "SKIP", str(e)
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top in PROJECT:
            traceback.print_exc()
            status, reason = "FAIL", f"ModuleNotFoundError: {e}"
        else:
            status, reason = "SKIP", f"Python module {e.name!r} is not installed for {sys.executable}"
    except BaseException as e:  # noqa: BLE001 - every failure is reported, KeyboardInterrupt and SIGTERM too
        traceback.print_exc()
        status, reason = "FAIL", f"{type(e).__name__}: {e}".strip()[:600]
    result = {"step": args.step, "status": status, "reason": reason,
              "seconds": round(time.perf_counter() - start, 1), **ctx.metrics}
    (ctx.out / f"{args.step}.json").write_text(json.dumps(result, default=str) + "\n")
    (ctx.out / f"{args.step}.status").write_text(f"{status}\t{' '.join(reason.split())}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

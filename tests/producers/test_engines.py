"""HFEngine on the tiny model: batching, stopping, logprob exactness, weight loading, interruption (SGLang:
test_sglang_engine.py)."""
import dataclasses
import threading

import numpy as np
import pytest
import torch

from producers.engines import GenerationInterrupted, SamplingParams, SwapGate
from producers.hf_engine import HFEngine, length_buckets

torch.set_num_threads(2)

PROMPTS = ["3+4=", "12+19=", "0+0=", "What is 7+8? "]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return HFEngine(tiny_model_dir, dtype=torch.float32, max_batch=3)


def _encode(engine, texts):
    return [engine.tokenizer.encode(t) for t in texts]


def test_behaviour_logprobs_match_teacher_forced_recompute(engine):
    """Left-padded, KV-cached sampling logprobs == one unpadded forward over prompt+output. The second
    chunk (max_batch=3) holds the open question twice, prefilled once and sampled independently."""
    batch = _encode(engine, PROMPTS + PROMPTS[3:] + PROMPTS[1:2])
    sampling = SamplingParams(max_new_tokens=12, temperature=0.7, stop_token_ids=(), seed=1)
    gens = engine.generate(batch, sampling)
    diffs = []
    with torch.inference_mode():
        for prompt, g in zip(batch, gens):
            assert g.output_ids.dtype == np.int32 and g.logprobs.dtype == np.float32
            assert len(g.output_ids) == 12 and g.finish_reason == "length"
            ids = torch.tensor([prompt + g.output_ids.tolist()])
            logits = engine.model(ids).logits[0, len(prompt) - 1:-1].float()
            ref = torch.log_softmax(logits / 0.7, -1).gather(1, ids[0, len(prompt):, None])[:, 0]
            diffs.append(np.abs(ref.numpy() - g.logprobs))
    assert np.concatenate(diffs).mean() < 1e-3
    assert np.all(np.concatenate([g.logprobs for g in gens]) <= 0)
    assert gens[3].output_ids.tolist() != gens[4].output_ids.tolist()  # shared prefill, separate samples


def test_stops_on_eos_and_seed_is_reproducible(engine):
    eos = engine.tokenizer.eos_token_id
    batch = _encode(engine, ["1+2=", "5+5=", "19+19="] * 2)
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, seed=7)
    gens = engine.generate(batch, sampling)
    again = engine.generate(batch, sampling)
    for g, h in zip(gens, again):
        np.testing.assert_array_equal(g.output_ids, h.output_ids)
        assert len(g.output_ids) == len(g.logprobs) <= 8
        if g.finish_reason == "stop":
            assert g.output_ids[-1] == eos and eos not in g.output_ids[:-1]
        else:
            assert len(g.output_ids) == 8 and eos not in g.output_ids
    # the pre-trained model usually ends a sum with <eos> in a few tokens
    assert sum(g.finish_reason == "stop" for g in gens) >= 4


def test_greedy_matches_hf_generate(engine):
    prompt = _encode(engine, ["11+6="])[0]
    ours = engine.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0))[0]
    ref = engine.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6,
                                pad_token_id=engine.pad_id)
    assert ours.output_ids.tolist() == ref[0, len(prompt):len(prompt) + len(ours.output_ids)].tolist()
    # a tiny top-p keeps only the most likely token: sampling becomes greedy, logprobs stay untruncated
    nucleus = engine.generate([prompt], SamplingParams(max_new_tokens=6, temperature=1.0, top_p=1e-6, seed=0))[0]
    assert nucleus.output_ids.tolist() == ours.output_ids.tolist()
    np.testing.assert_allclose(nucleus.logprobs, ours.logprobs, atol=1e-5)


def test_a_stop_string_ends_a_row_at_the_token_completing_it(tiny_model_dir):
    eng = HFEngine(tiny_model_dir, dtype=torch.float32)
    batch = _encode(eng, PROMPTS)
    greedy = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=())
    full = eng.generate(batch, greedy)
    decode = eng.tokenizer.decode
    stop = decode(full[0].output_ids[1:3].tolist())  # the text of the first row's 2nd and 3rd tokens
    cut = eng.generate(batch, dataclasses.replace(greedy, stop=(stop, "never generated")))
    for g, whole in zip(cut, full):  # a row stops with the first token whose text completes the stop string
        ends = [k for k in range(1, 13) if stop in decode(whole.output_ids[:k].tolist())]
        n = ends[0] if ends else 12
        assert (g.finish_reason, g.output_ids.tolist()) == ("stop" if ends else "length", whole.output_ids[:n].tolist())
        np.testing.assert_allclose(g.logprobs, whole.logprobs[:n], atol=1e-5)
    assert cut[0].output_ids.tolist() == full[0].output_ids[:3].tolist()
    with pytest.raises(ValueError, match="empty string"):
        SamplingParams(stop=("",))


def test_load_weights_in_place_sets_version(tiny_model_dir):
    eng = HFEngine(tiny_model_dir, dtype=torch.float32)
    batch = _encode(eng, PROMPTS)
    greedy = SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=())
    before = [g.output_ids.tolist() for g in eng.generate(batch, greedy)]
    assert eng.version == 0
    head = eng.model.get_output_embeddings().weight
    ptr = head.data_ptr()
    boosted = torch.zeros_like(head)
    boosted[eng.tokenizer.convert_tokens_to_ids("7")] = 10 * head.detach().abs().max()
    state = {name: p.detach().clone() for name, p in eng.model.state_dict().items()}
    assert "lm_head.weight" in state  # tied to the embedding: both names load
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        state[name] = head.detach() + boosted
    eng.load_weights(state, version=3)
    assert eng.version == 3 and head.data_ptr() == ptr
    gens = eng.generate(batch, greedy)
    assert all(g.version == 3 for g in gens)
    assert [g.output_ids.tolist() for g in gens] != before
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        eng.load_weights({"nope": torch.zeros(1)}, version=4)
    with pytest.raises(ValueError, match="shape"):
        eng.load_weights({name: torch.zeros(2, 2)}, version=4)
    assert eng.version == 3


def test_an_interrupt_stops_generation_at_the_next_decode_step_and_leaves_the_engine_usable(engine):
    """The interrupt is set during the third forward pass (prefill and two decode steps of the first chunk):
    no further pass runs, nothing is returned, and once cleared the engine generates as before."""
    batch = _encode(engine, PROMPTS)
    sampling = SamplingParams(max_new_tokens=50, temperature=0.7, stop_token_ids=(), seed=3)
    before = engine.generate(batch, sampling)
    interrupt, forwards = threading.Event(), []

    def count(*_):
        forwards.append(1)
        if len(forwards) == 3:
            interrupt.set()

    hook = engine.model.register_forward_hook(count)
    engine.interrupt = interrupt
    try:
        with pytest.raises(GenerationInterrupted):
            engine.generate(batch, sampling)
        assert len(forwards) == 3
        interrupt.clear()
        after = engine.generate(batch, sampling)
    finally:
        hook.remove()
        engine.interrupt = None
    assert [g.output_ids.tolist() for g in after] == [g.output_ids.tolist() for g in before]


def test_bad_sampling_params_are_rejected():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def test_rows_that_stop_leave_the_decode_batch_and_every_row_stays_exact(engine, tiny_model_dir):
    """32 rows (8 prompts x 4) stopping at EOS at different steps: the forward passes shrink as rows stop, and
    each row's tokens and logprobs are still its own (teacher-forced recompute); greedy rows equal a call per
    prompt, and chunks bounded by ``max_batch_tokens`` too."""
    eng = HFEngine(tiny_model_dir, dtype=torch.float32, max_batch=64)
    texts = ["1+2=", "5+5=", "19+19=", "What is 7+8? ", "0+0=", "13+6=", "2+17=", "9+9="]
    batch = [ids for ids in _encode(eng, texts) for _ in range(4)]
    widths = []
    hook = eng.model.register_forward_pre_hook(lambda _m, _a, kw: widths.append(kw["input_ids"].shape[0]),
                                               with_kwargs=True)
    try:
        gens = eng.generate(batch, SamplingParams(max_new_tokens=40, temperature=1.5, seed=5))
    finally:
        hook.remove()
    lengths = sorted(len(g.output_ids) for g in gens)
    assert lengths[0] < lengths[-1] and any(g.finish_reason == "stop" for g in gens)
    assert widths[0] == len(texts) and widths[1] == 32 and widths[-1] < 32  # prefill, first step, last step
    assert widths[1:] == sorted(widths[1:], reverse=True)
    eos = eng.tokenizer.eos_token_id
    with torch.inference_mode():
        for prompt, g in zip(batch, gens):
            assert (g.finish_reason == "stop") == (g.output_ids[-1] == eos) and eos not in g.output_ids[:-1]
            ids = torch.tensor([prompt + g.output_ids.tolist()])
            logits = eng.model(ids).logits[0, len(prompt) - 1:-1].float()
            ref = torch.log_softmax(logits / 1.5, -1).gather(1, ids[0, len(prompt):, None])[:, 0]
            np.testing.assert_allclose(g.logprobs, ref.numpy(), atol=1e-4)
    greedy = SamplingParams(max_new_tokens=40, temperature=0)
    together = eng.generate(_encode(eng, texts), greedy)
    for ids, g in zip(_encode(eng, texts), together):
        [alone] = eng.generate([ids], greedy)
        assert g.output_ids.tolist() == alone.output_ids.tolist() and g.finish_reason == alone.finish_reason
        np.testing.assert_allclose(g.logprobs, alone.logprobs, atol=1e-5)
    # chunks bounded by KV positions: rows x (longest prompt + max_new_tokens) <= max_batch_tokens, 3 rows here
    eng.max_batch_tokens = 3 * (max(map(len, _encode(eng, texts))) + 40) + 2
    widths.clear()
    hook = eng.model.register_forward_pre_hook(lambda _m, _a, kw: widths.append(kw["input_ids"].shape),
                                               with_kwargs=True)
    try:
        chunked = eng.generate(_encode(eng, texts), greedy)
    finally:
        hook.remove()
    assert [w[0] for w in widths if w[1] > 1] == [3, 3, 2]  # the prefills
    assert [g.output_ids.tolist() for g in chunked] == [g.output_ids.tolist() for g in together]


def test_a_swap_waits_for_generations_in_flight_and_holds_back_new_ones():
    gate, log = SwapGate(), []
    in_flight, release = [threading.Event() for _ in range(3)], threading.Event()

    def generation(i, started=None):
        with gate.generating():
            log.append(f"gen{i} start")
            if started is not None:
                started.set()
                assert release.wait(60)
            log.append(f"gen{i} end")

    def swap():
        with gate.swapping():
            log.append("swap")

    first = [threading.Thread(target=generation, args=(i, in_flight[i])) for i in range(3)]
    for t in first:
        t.start()
    assert all(e.wait(60) for e in in_flight)
    swapper = threading.Thread(target=swap)
    swapper.start()
    while gate._swaps_waiting == 0:  # the swap is waiting on the three generations
        swapper.join(0.01)
    late = threading.Thread(target=generation, args=(3,))  # asked for while the swap waits: it goes after the swap
    late.start()
    late.join(0.5)
    assert late.is_alive() and "swap" not in log and "gen3 start" not in log, log
    release.set()
    for t in (*first, swapper, late):
        t.join(60)
        assert not t.is_alive()
    assert log.index("swap") > max(log.index(f"gen{i} end") for i in range(3)), log
    assert log.index("gen3 start") > log.index("swap"), log


def test_prompts_of_very_different_lengths_are_prefilled_in_buckets_and_each_row_stays_exact(tiny_model_dir):
    """Four short prompts and four about ten times longer in one call: two prefill passes, each at its bucket's
    width, whose caches are joined; every row's tokens and logprobs equal a call of that prompt alone."""
    eng = HFEngine(tiny_model_dir, dtype=torch.float32, max_batch=64)
    short = ["1+2=", "5+5=", "0+0=", "9+9="]
    long_ = [" ".join(f"What is {a}+{a + 1}?" for a in range(k, k + 12)) + " 3+4=" for k in range(4)]
    batch = [p for pair in zip(_encode(eng, short), _encode(eng, long_)) for p in pair]
    assert length_buckets([len(p) for p in batch]) == [[1, 3, 5, 7], [0, 2, 4, 6]]
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    eng.generate(batch[:1], greedy)  # the first prefill finds that caches can be joined
    shapes = []
    hook = eng.model.register_forward_pre_hook(lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                               with_kwargs=True)
    try:
        together = eng.generate(batch, SamplingParams(max_new_tokens=12, temperature=0))
    finally:
        hook.remove()
    widths = sorted(len(p) for p in batch)
    assert sorted(s for s in shapes if s[1] > 1) == [(4, widths[3]), (4, widths[-1])]  # two prefills
    for ids, g in zip(batch, together):
        [alone] = eng.generate([ids], greedy)
        assert g.output_ids.tolist() == alone.output_ids.tolist()
        np.testing.assert_allclose(g.logprobs, alone.logprobs, atol=1e-5)

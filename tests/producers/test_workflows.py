"""Workflows on the tiny model: group shapes, loss masks, versions and rewards."""
import asyncio

import numpy as np
import pytest
import torch

from producers.engines import Engine, Generation, SamplingParams
from producers.hf_engine import HFEngine
from producers.workflows import (WORKFLOWS, accepts, episode_ended, gather_episodes, get_workflow, group_id_for,
                                 prompt_ids)
from topics.codec import decode, encode
from topics.schemas import Prompt, TrajectoryGroup

torch.set_num_threads(2)
SAMPLING = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return HFEngine(tiny_model_dir, dtype=torch.float32)


def arith(workflow: str, g: int = 6) -> Prompt:
    return Prompt(prompt_id="p-3+4", source="test", task_type="arith", text="3+4=", answer="7",
                  workflow=workflow, n_samples=g)


def segments(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) runs of mask == 1."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def check_sample_arrays(s, prompt_len: int) -> None:
    assert s.input_ids.dtype == np.int32 and s.loss_mask.dtype == np.uint8
    assert s.behavior_logprobs.dtype == np.float32 and s.versions.dtype == np.int32
    gen = s.loss_mask == 1
    assert not gen[:prompt_len].any() and gen.any()
    assert np.all(s.behavior_logprobs[~gen] == 0) and np.all(s.behavior_logprobs[gen] <= 0)
    assert np.all(s.versions[~gen] == -1) and np.all(s.versions[gen] >= 0)


def test_registry_and_verdict_rule():
    assert {"single_turn", "solve_verify_retry", "multi_turn"} <= set(WORKFLOWS)
    with pytest.raises(KeyError, match="unknown workflow 'nope'"):
        get_workflow("nope")
    with pytest.raises(ValueError, match="no role"):
        get_workflow("single_turn", policies={"critic": "x"})
    assert accepts(" 1") and accepts("yes") and accepts("Y") and not accepts("0") and not accepts("  ")


def test_single_turn(engine):
    from producers.rewards import score

    engine.load_weights({}, version=2)
    prompt = arith("single_turn")
    groups = get_workflow("single_turn").run(prompt, {"actor": engine}, SAMPLING)
    assert len(groups) == 1
    group = groups[0]
    assert group.policy == "actor" and group.prompt_id == prompt.prompt_id and len(group.samples) == 6
    assert group.workflow == "single_turn" and group.min_version == group.max_version == 2
    # the group id is the delivery's identity: a redelivery gets the same id, the next epoch a new one
    again = get_workflow("single_turn").run(prompt, {"actor": engine}, SAMPLING)[0]
    next_epoch = prompt.model_copy(update={"metadata": {**prompt.metadata, "epoch": 1}})
    assert again.group_id == group.group_id == group_id_for(prompt, "actor", "policy")
    assert get_workflow("single_turn").run(next_epoch, {"actor": engine}, SAMPLING)[0].group_id != group.group_id
    ids = prompt_ids(engine.tokenizer, prompt)
    for s in group.samples:
        assert s.input_ids[:len(ids)].tolist() == ids
        check_sample_arrays(s, len(ids))
        assert set(s.versions[s.loss_mask == 1].tolist()) == {2} and s.turns == 1
        completion = engine.tokenizer.decode(s.input_ids[len(ids):].tolist(), skip_special_tokens=True)
        assert s.reward == score(prompt, completion)
    assert group.reward_mean == pytest.approx(np.mean([s.reward for s in group.samples]))
    back = decode(encode(group), expect=TrajectoryGroup)
    assert back.group_id == group.group_id and back.samples[0].input_ids.tolist() == group.samples[0].input_ids.tolist()
    with pytest.raises(KeyError, match="needs an engine for policy 'actor'"):
        get_workflow("single_turn").run(prompt, {"other": engine}, SAMPLING)


@pytest.mark.parametrize("verdicts", [None, ["y", "n"] * 4])
def test_solve_verify_retry(engine, tiny_model_dir, verdicts):
    """With the tiny model as verifier (whatever it decides), and with scripted verdicts that accept
    samples 0, 2, 4, 6 and reject 1, 3, 5, 7, so that both branches surely run."""
    from producers.rewards import score

    verifier = (HFEngine(tiny_model_dir, dtype=torch.float32, version=4) if verdicts is None
                else ScriptedEngine(engine.tokenizer, [verdicts], version=4))
    prompt = arith("solve_verify_retry", g=8)
    wf = get_workflow("solve_verify_retry", verifier_max_new_tokens=3)
    solver_group, verifier_group = wf.run(prompt, {"solver": engine, "verifier": verifier}, SAMPLING)
    assert solver_group.policy == "solver" and verifier_group.policy == "verifier"
    assert solver_group.group_id != verifier_group.group_id
    assert len(solver_group.samples) == len(verifier_group.samples) == 8
    assert verifier_group.min_version == 4
    tok = engine.tokenizer
    ids = prompt_ids(tok, prompt)
    retried = 0
    for s, v in zip(solver_group.samples, verifier_group.samples):
        check_sample_arrays(s, len(ids))
        (a0, a1), *rest = segments(s.loss_mask)
        first = tok.decode(s.input_ids[a0:a1].tolist(), skip_special_tokens=True)
        [(v0, v1)] = segments(v.loss_mask)
        assert v1 == len(v.input_ids) and v1 - v0 <= 3 and v.turns == 1
        verdict = tok.decode(v.input_ids[v0:v1].tolist(), skip_special_tokens=True)
        # the verifier saw the problem and the solver's first answer
        assert tok.decode(v.input_ids[:v0].tolist(), skip_special_tokens=True).startswith("3+4=" + first)
        truth = score(prompt, first) > 0.5
        assert v.reward == float(accepts(verdict) == truth)
        if accepts(verdict):
            assert rest == [] and s.turns == 1 and s.reward == score(prompt, first)
        else:
            retried += 1
            [(b0, b1)] = rest
            assert s.turns == 2 and b1 == len(s.input_ids)
            feedback = tok.decode(s.input_ids[a1:b0].tolist(), skip_special_tokens=True)
            assert feedback.startswith("\nVerifier: ") and feedback.endswith("Try again: ")
            second = tok.decode(s.input_ids[b0:b1].tolist(), skip_special_tokens=True)
            assert s.reward == score(prompt, second)
    if verdicts is not None:
        assert retried == 4


class ScriptedEngine(Engine):
    """An engine that replies with fixed texts, for driving workflows: ``replies`` is a list with one reply per
    generate call (a text for every prompt of the batch, or a list of texts, one per prompt), or a function
    of each prompt's text (episodes progress on their own, so the calls they share depend on timing)."""

    def __init__(self, tokenizer, replies, version=7):
        self._tokenizer, self._version, self.seen = tokenizer, version, []
        self.replies = replies if callable(replies) else list(replies)

    def generate(self, batch, sampling):
        self.seen.append([list(b) for b in batch])
        if callable(self.replies):
            reply = [self.replies(self._tokenizer.decode(b)) for b in batch]
        else:
            reply = self.replies.pop(0)
        out = []
        for text in reply if isinstance(reply, list) else [reply] * len(batch):
            ids = np.array(self._tokenizer.encode(text, add_special_tokens=False) + [self._tokenizer.eos_token_id], np.int32)
            out.append(Generation(ids, np.full(len(ids), -0.5, np.float32), "stop", self._version))
        return out

    def load_weights(self, state_dict, version):
        self._version = version


def test_multi_turn_runs_python_tool_in_sandbox(engine):
    tok = engine.tokenizer
    scripted = ScriptedEngine(tok, lambda text: "7" if "<output>" in text else "<python>print(3+4)</python> ignored tail")
    prompt = arith("multi_turn", g=2)
    [group] = get_workflow("multi_turn", max_turns=3).run(prompt, {"actor": scripted}, SAMPLING)
    ids = prompt_ids(tok, prompt)
    for s in group.samples:
        check_sample_arrays(s, len(ids))
        (a0, a1), (b0, b1) = segments(s.loss_mask)
        assert tok.decode(s.input_ids[a0:a1].tolist()) == "<python>print(3+4)</python>"
        assert tok.decode(s.input_ids[a1:b0].tolist()) == "\n<output>\n7\n</output>\n"
        assert s.turns == 2 and s.reward == 1.0 and set(s.versions[s.loss_mask == 1]) == {7}
    # the second turns saw the tool output in their context
    seconds = [tok.decode(b) for call in scripted.seen for b in call if "<output>" in tok.decode(b)]
    assert len(seconds) == 2 and all(t.endswith("</python>\n<output>\n7\n</output>\n") for t in seconds)


def test_multi_turn_stops_at_max_turns_and_on_the_tiny_model(engine):
    tok = engine.tokenizer
    scripted = ScriptedEngine(tok, ["<python>print(1)</python>"] * 2)
    [group] = get_workflow("multi_turn", max_turns=2).run(arith("multi_turn", g=1), {"actor": scripted}, SAMPLING)
    assert group.samples[0].turns == 2 and len(segments(group.samples[0].loss_mask)) == 2
    [group] = get_workflow("multi_turn").run(arith("multi_turn", g=3), {"actor": engine}, SAMPLING)
    for s in group.samples:
        check_sample_arrays(s, len(prompt_ids(tok, arith("multi_turn"))))
        assert s.turns == 1


def assert_same_groups(a: list[TrajectoryGroup], b: list[TrajectoryGroup], atol: float = 0.0) -> None:
    """Two runs' groups are the same: ids, metadata, tokens, masks, versions, rewards (logprobs within ``atol``)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        skip = {"samples", "created_ts"}
        assert x.model_dump(exclude=skip) == y.model_dump(exclude=skip)
        assert len(x.samples) == len(y.samples)
        for s, t in zip(x.samples, y.samples):
            for field in ("input_ids", "loss_mask", "versions"):
                np.testing.assert_array_equal(getattr(s, field), getattr(t, field))
            np.testing.assert_allclose(s.behavior_logprobs, t.behavior_logprobs, atol=atol)
            assert (s.reward, s.finish_reason, s.turns) == (t.reward, t.finish_reason, t.turns)


def test_concurrent_rollouts_share_one_generate_call_and_make_the_groups_of_each_alone(engine):
    """Three prompts rolled out at once on one EngineBatcher: every prompt's G copies go in one engine call, and
    each prompt gets the groups a rollout of it alone gets: the same group ids, tokens, versions and rewards
    (scripted replies, some correct; then the tiny model, greedy, where left padding to the batch's longest
    prompt changes logprobs by float noise)."""
    import asyncio

    from producers.engine_batcher import EngineBatcher

    prompts = [Prompt(prompt_id=f"p{i}", source="test", task_type="arith", text=text, answer=answer,
                      workflow="single_turn", n_samples=g, metadata={"epoch": i % 2})
               for i, (text, answer, g) in enumerate([("3+4=", "7", 8), ("What is 1+2? ", "3", 4),
                                                       ("0+1=", "1", 3)])]
    wf = get_workflow("single_turn")

    def together(eng, sampling):
        async def go():
            batcher = EngineBatcher(eng)
            try:
                return await asyncio.gather(*(wf.rollout(p, {"actor": batcher}, sampling, {}) for p in prompts))
            finally:
                batcher.close()
        return asyncio.run(go())

    replies = [[str(k) for k in range(p.n_samples)] for p in prompts]  # sample k answers k
    one = ScriptedEngine(engine.tokenizer, [sum(replies, [])], version=5)
    batched = together(one, SAMPLING)
    assert len(one.seen) == 1 and one.seen[0] == [prompt_ids(engine.tokenizer, p) for p in prompts
                                                  for _ in range(p.n_samples)]
    each = ScriptedEngine(engine.tokenizer, replies, version=5)
    alone = [wf.run(p, {"actor": each}, SAMPLING) for p in prompts]
    assert len(each.seen) == 3
    for p, groups, ref in zip(prompts, batched, alone):
        assert_same_groups(groups, ref)
        [group] = groups
        assert group.group_id == group_id_for(p, "actor", "policy") and group.prompt_id == p.prompt_id
        assert [s.reward for s in group.samples] == [float(k == int(p.answer)) for k in range(p.n_samples)]
        assert group.min_version == group.max_version == 5

    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    engine.load_weights({}, version=1)
    batched = together(engine, greedy)
    for p, groups in zip(prompts, batched):
        assert_same_groups(groups, wf.run(p, {"actor": engine}, greedy), atol=1e-5)


def test_a_scheduler_hears_each_episode_end_as_it_ends():
    """gather_episodes returns results in order and calls the scheduler's episode_ended hook as each episode
    ends (the RaaS worker counts the running ones against raas.max_episodes), not when the slowest does."""
    async def episode(delay: float, value: int) -> int:
        await asyncio.sleep(delay)
        return value

    async def rollout() -> tuple[list[int], list[tuple[int, float]]]:
        running, heard, start = [3], [], asyncio.get_running_loop().time()

        def ended() -> None:
            running[0] -= 1
            heard.append((running[0], asyncio.get_running_loop().time() - start))

        episode_ended.set(ended)
        return await gather_episodes([episode(0.3, 1), episode(0.0, 2), episode(0.1, 3)]), heard

    results, heard = asyncio.run(rollout())
    assert results == [1, 2, 3]
    assert [n for n, _ in heard] == [2, 1, 0]
    assert heard[0][1] < heard[1][1] < 0.29 <= heard[2][1], heard  # the quick ones are heard before the slowest ends
    assert asyncio.run(gather_episodes([episode(0, 7)])) == [7]  # no scheduler: nothing to tell

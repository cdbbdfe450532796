"""Agent workflows: how a rollout turns one Prompt into scored trajectory groups.

A workflow runs one :class:`~topics.schemas.Prompt` with G = ``prompt.n_samples``
samples on one engine per policy and returns one
:class:`~topics.schemas.TrajectoryGroup` per *role* it ran (DESIGN.md,
"Multi-policy"); each role is played by a policy, named in the workflow's
config (``policies={"solver": "solver", ...}``). When two roles share a policy,
that policy gets two groups (advantages are then normalised per role).

In every sample, ``loss_mask`` is 1 only on tokens that the group's policy
generated; prompt, feedback and tool-output tokens (and another role's tokens)
have ``loss_mask`` 0, ``behavior_logprobs`` 0 and ``versions`` -1. Generated
tokens carry the engine's behaviour logprob (convention in
:mod:`producers.engines`) and the weight version that sampled them.

Workflows are looked up by name in :data:`WORKFLOWS` (``get_workflow``); add
one with ``@register_workflow("name")``.
"""
from __future__ import annotations

import abc
import dataclasses
import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, ClassVar, Mapping

import numpy as np

from producers.engines import Engine, Generation, SamplingParams
from producers.rewards import score_many
from producers.sandbox import SandboxLimits, run_python
from topics.schemas import Prompt, Sample, TrajectoryGroup

WORKFLOWS: dict[str, type["Workflow"]] = {}


def register_workflow(name: str) -> Callable[[type["Workflow"]], type["Workflow"]]:
    """Class decorator adding a :class:`Workflow` subclass to :data:`WORKFLOWS` under ``name``.

    Raises:
        ValueError: ``name`` is already registered.
    """
    def deco(cls: type[Workflow]) -> type[Workflow]:
        if name in WORKFLOWS:
            raise ValueError(f"workflow {name!r} is already registered (by {WORKFLOWS[name].__name__})")
        cls.name = name
        WORKFLOWS[name] = cls
        return cls
    return deco


def get_workflow(name: str, **config: Any) -> "Workflow":
    """Instantiate the workflow registered as ``name`` with ``config`` (``policies=...`` and options).

    Raises:
        KeyError: no workflow of that name (the message lists the known ones).
        ValueError/TypeError: a bad config (unknown role or option).
    """
    if name not in WORKFLOWS:
        raise KeyError(f"unknown workflow {name!r}; registered: {sorted(WORKFLOWS)}")
    return WORKFLOWS[name](**config)


def prompt_ids(tokenizer: Any, prompt: Prompt | str) -> list[int]:
    """Token ids of a prompt: its ``messages`` (or ``text`` as one user turn) through the chat template.

    A tokenizer without a chat template encodes the text with its special tokens.
    """
    if isinstance(prompt, str):
        messages, text = None, prompt
    else:
        messages, text = prompt.messages, prompt.text
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(messages or [{"role": "user", "content": text}],
                                                 tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(rendered, add_special_tokens=False)
    return tokenizer.encode(text if text is not None else "\n".join(m["content"] for m in messages))


def problem_text(prompt: Prompt) -> str:
    """The prompt as plain text: ``text``, or the message contents joined by newlines."""
    return prompt.text if prompt.text is not None else "\n".join(m["content"] for m in prompt.messages)


class Trajectory:
    """A token sequence under construction for one role, with its per-token arrays."""

    def __init__(self, ids: list[int]) -> None:
        self.ids: list[int] = list(ids)
        self.mask: list[int] = [0] * len(ids)
        self.logprobs: list[float] = [0.0] * len(ids)
        self.versions: list[int] = [-1] * len(ids)
        self.turns = 0
        self.finish_reason = "stop"

    def add_context(self, ids: list[int]) -> None:
        """Append tokens this role did not generate (feedback, tool output): mask 0, version -1."""
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_generation(self, gen: Generation) -> None:
        """Append a generation of this role: mask 1, its behaviour logprobs and version; counts a turn."""
        n = len(gen.output_ids)
        self.ids += gen.output_ids.tolist()
        self.mask += [1] * n
        self.logprobs += gen.logprobs.tolist()
        self.versions += [gen.version] * n
        self.turns += 1
        self.finish_reason = gen.finish_reason

    def to_sample(self, reward: float) -> Sample:
        """The finished :class:`Sample` with ``reward``."""
        return Sample(input_ids=np.asarray(self.ids, np.int32), loss_mask=np.asarray(self.mask, np.uint8),
                      behavior_logprobs=np.asarray(self.logprobs, np.float32),
                      versions=np.asarray(self.versions, np.int32), reward=float(reward),
                      finish_reason=self.finish_reason, turns=self.turns)


def _text(engine: Engine, ids: np.ndarray | list[int]) -> str:
    return engine.tokenizer.decode(list(ids), skip_special_tokens=True)


class Workflow(abc.ABC):
    """One agent workflow. Subclasses set ``roles`` (role -> default policy name) and implement :meth:`run`.

    Args:
        policies: role -> policy name overrides of ``roles``.

    Raises:
        ValueError: ``policies`` names a role the workflow does not have.
    """

    name: ClassVar[str] = ""
    roles: ClassVar[dict[str, str]] = {}

    def __init__(self, policies: Mapping[str, str] | None = None) -> None:
        unknown = set(policies or {}) - set(self.roles)
        if unknown:
            raise ValueError(f"workflow {self.name!r} has no role(s) {sorted(unknown)}; its roles are "
                             f"{sorted(self.roles)}")
        self.policies = {**self.roles, **(policies or {})}

    @abc.abstractmethod
    def run(self, prompt: Prompt, engines: Mapping[str, Engine], sampling: SamplingParams) -> list[TrajectoryGroup]:
        """Roll out ``prompt`` G times and return one group per role.

        Args:
            prompt: the prompt; G is ``prompt.n_samples``.
            engines: policy name -> engine, covering every policy in :attr:`policies`.
            sampling: sampling parameters for every generation.

        Raises:
            KeyError: no engine for a policy this workflow needs.
        """

    def run_batch(self, prompts: list[Prompt], engines: Mapping[str, Engine],
                  sampling: SamplingParams) -> list[list[TrajectoryGroup]]:
        """Roll out several prompts: ``[self.run(p, ...) for p in prompts]``, the groups of each prompt in
        order. A workflow that can share engine calls across prompts overrides it (:attr:`batches`); its
        groups must be those :meth:`run` makes (ids, rewards, versions), sampling aside. An exception (e.g.
        :class:`~producers.engines.GenerationInterrupted`) drops the whole call: no groups are returned.

        Raises:
            KeyError: no engine for a policy this workflow needs.
        """
        return [self.run(p, engines, sampling) for p in prompts]

    @property
    def batches(self) -> bool:
        """True when :meth:`run_batch` rolls prompts out together (one engine call per policy for the lot),
        not one after another: the RaaS worker then hands it a whole batch, else one prompt per call."""
        return type(self).run_batch is not Workflow.run_batch

    def engine(self, engines: Mapping[str, Engine], role: str) -> Engine:
        """The engine playing ``role``.

        Raises:
            KeyError: ``engines`` has no entry for the role's policy.
        """
        policy = self.policies[role]
        if policy not in engines:
            raise KeyError(f"workflow {self.name!r} needs an engine for policy {policy!r} (role {role!r}); "
                           f"got engines for {sorted(engines)}")
        return engines[policy]

    def group(self, prompt: Prompt, role: str, samples: list[Sample]) -> TrajectoryGroup:
        """The group of ``samples`` that ``role``'s policy produced for ``prompt``, with its
        :func:`group_id_for` id (each role makes one group per run of the workflow)."""
        policy = self.policies[role]
        return TrajectoryGroup.build(samples=samples, prompt_id=prompt.prompt_id,
                                     group_id=group_id_for(prompt, policy, role),
                                     policy=policy, source=prompt.source,
                                     task_type=prompt.task_type, workflow=self.name)


def group_id_for(prompt: Prompt, policy: str, role: str) -> str:
    """The de-duplication key of the group ``role`` (played by ``policy``) makes for one delivery of
    ``prompt``: sha256 of (prompt_id, epoch, policy, role), 32 hex characters. A redelivered prompt
    (a RaaS worker crashed before its commit) gets the same ids, which the serving stage de-duplicates;
    the next epoch's rollout of the prompt gets new ones."""
    key = f"{prompt.prompt_id}\x00{prompt.metadata.get('epoch', 0)}\x00{policy}\x00{role}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


@register_workflow("single_turn")
class SingleTurn(Workflow):
    """G samples of one answer each, generated in one batch; reward from :func:`producers.rewards.score_many`.

    :meth:`run_batch` generates the G copies of every prompt of a batch in one ``generate`` call (the
    engine prefills each distinct prompt once); :meth:`run` is the batch of one prompt.
    """

    roles: ClassVar[dict[str, str]] = {"policy": "actor"}

    def run(self, prompt: Prompt, engines: Mapping[str, Engine], sampling: SamplingParams) -> list[TrajectoryGroup]:
        return self.run_batch([prompt], engines, sampling)[0]

    def run_batch(self, prompts: list[Prompt], engines: Mapping[str, Engine],
                  sampling: SamplingParams) -> list[list[TrajectoryGroup]]:
        eng = self.engine(engines, "policy")
        if not prompts:
            return []
        ids = [prompt_ids(eng.tokenizer, p) for p in prompts]
        gens = eng.generate([x for p, x in zip(prompts, ids) for _ in range(p.n_samples)], sampling)
        out, at = [], 0
        for prompt, x in zip(prompts, ids):
            mine, at = gens[at:at + prompt.n_samples], at + prompt.n_samples
            rewards = score_many(prompt, [_text(eng, g.output_ids) for g in mine])
            trajs = [Trajectory(x) for _ in mine]
            for t, g in zip(trajs, mine):
                t.add_generation(g)
            out.append([self.group(prompt, "policy", [t.to_sample(r) for t, r in zip(trajs, rewards)])])
        return out


def accepts(verdict: str) -> bool:
    """The verdict parse rule: the first non-space character is ``1``, ``y`` or ``Y``."""
    text = verdict.lstrip()
    return bool(text) and text[0] in "1yY"


@register_workflow("solve_verify_retry")
class SolveVerifyRetry(Workflow):
    """Solver answers, verifier judges, and a rejected answer is retried once with the verifier's text.

    Per sample: the solver answers the prompt; the verifier sees
    ``verifier_template`` filled with the problem and that answer, and its
    verdict is parsed by :func:`accepts`. If it rejects, ``retry_template``
    (with the verdict text) is appended to the solver's trajectory as context
    and the solver answers again.

    Rewards: the solver gets the score of its final answer; the verifier gets
    1.0 when its verdict matches the truth (the first answer scores > 0.5)
    and 0.0 otherwise. Returns the solver's group, then the verifier's.

    Args:
        policies: role overrides; roles ``solver`` and ``verifier``.
        verifier_template: format string with ``{problem}`` and ``{answer}``.
        retry_template: format string with ``{verdict}``, appended before the retry.
        verifier_max_new_tokens: the verdict's token budget (default: the sampling's).
    """

    roles: ClassVar[dict[str, str]] = {"solver": "solver", "verifier": "verifier"}

    def __init__(self, policies: Mapping[str, str] | None = None,
                 verifier_template: str = "{problem}{answer}\nCorrect (1/0)? ",
                 retry_template: str = "\nVerifier: {verdict}\nTry again: ",
                 verifier_max_new_tokens: int | None = None) -> None:
        super().__init__(policies)
        self.verifier_template = verifier_template
        self.retry_template = retry_template
        self.verifier_max_new_tokens = verifier_max_new_tokens

    def run(self, prompt: Prompt, engines: Mapping[str, Engine], sampling: SamplingParams) -> list[TrajectoryGroup]:
        solver, verifier = self.engine(engines, "solver"), self.engine(engines, "verifier")
        ids = prompt_ids(solver.tokenizer, prompt)
        g = prompt.n_samples
        first = solver.generate([ids] * g, sampling)
        answers = [_text(solver, x.output_ids) for x in first]
        correct = [r > 0.5 for r in score_many(prompt, answers)]
        sol = [Trajectory(ids) for _ in range(g)]
        for t, x in zip(sol, first):
            t.add_generation(x)

        problem = problem_text(prompt)
        ver = [Trajectory(prompt_ids(verifier.tokenizer, self.verifier_template.format(problem=problem, answer=a)))
               for a in answers]
        v_sampling = sampling
        if self.verifier_max_new_tokens is not None:
            v_sampling = dataclasses.replace(sampling, max_new_tokens=self.verifier_max_new_tokens)
        verdicts = verifier.generate([t.ids for t in ver], v_sampling)
        verdict_texts = [_text(verifier, v.output_ids) for v in verdicts]
        accepted = [accepts(v) for v in verdict_texts]
        for t, v in zip(ver, verdicts):
            t.add_generation(v)

        final = list(answers)
        retry = [i for i in range(g) if not accepted[i]]
        if retry:
            for i in retry:
                feedback = self.retry_template.format(verdict=verdict_texts[i].strip())
                sol[i].add_context(solver.tokenizer.encode(feedback, add_special_tokens=False))
            second = solver.generate([sol[i].ids for i in retry], sampling)
            for i, x in zip(retry, second):
                sol[i].add_generation(x)
                final[i] = _text(solver, x.output_ids)
        solver_rewards = score_many(prompt, final)
        verifier_rewards = [float(a == c) for a, c in zip(accepted, correct)]
        return [self.group(prompt, "solver", [t.to_sample(r) for t, r in zip(sol, solver_rewards)]),
                self.group(prompt, "verifier", [t.to_sample(r) for t, r in zip(ver, verifier_rewards)])]


@register_workflow("plan_execute_critique")
class PlanExecuteCritique(Workflow):
    """Three roles: a planner writes a plan, an executor answers following it, a critic judges the answer.

    Per sample: the planner sees ``planner_template`` (with ``{problem}``) and
    generates a plan; the executor sees ``executor_template`` (with ``{plan}``
    and ``{problem}``; the plan is context, loss_mask 0) and generates the
    answer; the critic sees ``critic_template`` (with ``{problem}``, ``{plan}``
    and ``{answer}``) and generates a verdict, parsed by :func:`accepts`. Each
    role has its own trajectory, so its group's loss mask covers only the
    tokens that role generated.

    Rewards (``c`` = :func:`producers.rewards.score_many` of the executor's answer):

    - executor: ``c``, the correctness of its final answer;
    - planner: ``c`` too: the shared outcome is credited to the plan that led to
      it (the outcome-level credit assignment of multi-agent RL, as for a
      solver's retry in ``solve_verify_retry``); within a GRPO group the
      advantage then compares plans by the answers they produced;
    - critic: 1.0 when its verdict matches the answer's actual correctness
      (``accepts(verdict) == (c > 0.5)``), else 0.0.

    Returns the planner's, the executor's and the critic's group, in that order.

    Args:
        policies: role overrides; roles ``planner``, ``executor`` and ``critic``.
        planner_template, executor_template, critic_template: the roles' prompts (format strings).
        plan_max_new_tokens, critic_max_new_tokens: token budgets of the plan and the verdict
            (default: the sampling's ``max_new_tokens``).
    """

    roles: ClassVar[dict[str, str]] = {"planner": "planner", "executor": "executor", "critic": "critic"}

    def __init__(self, policies: Mapping[str, str] | None = None,
                 planner_template: str = "{problem}\nPlan: ",
                 executor_template: str = "Plan: {plan}\n{problem}",
                 critic_template: str = "{problem}{answer}\nCorrect (1/0)? ",
                 plan_max_new_tokens: int | None = None, critic_max_new_tokens: int | None = None) -> None:
        super().__init__(policies)
        self.planner_template, self.executor_template = planner_template, executor_template
        self.critic_template = critic_template
        self.plan_max_new_tokens, self.critic_max_new_tokens = plan_max_new_tokens, critic_max_new_tokens

    @staticmethod
    def _budget(sampling: SamplingParams, max_new_tokens: int | None) -> SamplingParams:
        return sampling if max_new_tokens is None else dataclasses.replace(sampling, max_new_tokens=max_new_tokens)

    def run(self, prompt: Prompt, engines: Mapping[str, Engine], sampling: SamplingParams) -> list[TrajectoryGroup]:
        planner, executor = self.engine(engines, "planner"), self.engine(engines, "executor")
        critic = self.engine(engines, "critic")
        g, problem = prompt.n_samples, problem_text(prompt)

        plan_ids = prompt_ids(planner.tokenizer, self.planner_template.format(problem=problem))
        plans = planner.generate([plan_ids] * g, self._budget(sampling, self.plan_max_new_tokens))
        plan_texts = [_text(planner, x.output_ids).strip() for x in plans]
        plan_trajs = [Trajectory(plan_ids) for _ in range(g)]
        for t, x in zip(plan_trajs, plans):
            t.add_generation(x)

        exe_trajs = [Trajectory(prompt_ids(executor.tokenizer, self.executor_template.format(plan=p, problem=problem)))
                     for p in plan_texts]
        answers = executor.generate([t.ids for t in exe_trajs], sampling)
        answer_texts = [_text(executor, x.output_ids) for x in answers]
        for t, x in zip(exe_trajs, answers):
            t.add_generation(x)
        outcome = score_many(prompt, answer_texts)

        critic_trajs = [Trajectory(prompt_ids(critic.tokenizer, self.critic_template.format(
            problem=problem, plan=p, answer=a))) for p, a in zip(plan_texts, answer_texts)]
        verdicts = critic.generate([t.ids for t in critic_trajs], self._budget(sampling, self.critic_max_new_tokens))
        for t, x in zip(critic_trajs, verdicts):
            t.add_generation(x)
        critic_rewards = [float(accepts(_text(critic, x.output_ids)) == (c > 0.5)) for x, c in zip(verdicts, outcome)]
        return [self.group(prompt, "planner", [t.to_sample(r) for t, r in zip(plan_trajs, outcome)]),
                self.group(prompt, "executor", [t.to_sample(r) for t, r in zip(exe_trajs, outcome)]),
                self.group(prompt, "critic", [t.to_sample(r) for t, r in zip(critic_trajs, critic_rewards)])]


@register_workflow("multi_turn")
class MultiTurn(Workflow):
    """A Python tool loop: code between ``tool_open`` and ``tool_close`` runs in the sandbox.

    Each turn, every unfinished sample generates; its output is cut just after
    the first ``tool_close`` (the tokens kept are a prefix of what was sampled,
    so their logprobs stay exact). A turn with a complete tool call runs the code
    with :func:`producers.sandbox.run_python` and appends ``output_template``
    (filled with stdout, plus stderr when the run failed) as context with
    loss_mask 0; the sample then takes another turn, up to ``max_turns`` model
    turns. The reward is the score of the last model turn's text.

    Args:
        policies: role overrides; role ``policy``.
        max_turns: the most model turns per sample.
        tool_open, tool_close: the tool-call delimiters.
        output_template: format string with ``{output}`` for the tool turn.
        tool_timeout_s: wall-clock limit of one tool run, seconds (CPU limit: its ceiling).
    """

    roles: ClassVar[dict[str, str]] = {"policy": "actor"}

    def __init__(self, policies: Mapping[str, str] | None = None, max_turns: int = 3,
                 tool_open: str = "<python>", tool_close: str = "</python>",
                 output_template: str = "\n<output>\n{output}</output>\n", tool_timeout_s: float = 5.0) -> None:
        super().__init__(policies)
        if max_turns < 1:
            raise ValueError(f"multi_turn max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        self.tool_open, self.tool_close = tool_open, tool_close
        self.output_template = output_template
        self.tool_timeout_s = tool_timeout_s

    def tool_call(self, text: str) -> str | None:
        """The code of the first complete tool call in ``text``, or None."""
        start = text.find(self.tool_open)
        if start < 0:
            return None
        end = text.find(self.tool_close, start + len(self.tool_open))
        return None if end < 0 else text[start + len(self.tool_open):end]

    def _cut_after_call(self, engine: Engine, gen: Generation) -> Generation:
        """``gen`` cut just after its first complete tool call (unchanged when it has none)."""
        text = _text(engine, gen.output_ids)
        if self.tool_call(text) is None:
            return gen
        for k in range(1, len(gen.output_ids) + 1):
            if self.tool_call(_text(engine, gen.output_ids[:k])) is not None:
                return Generation(output_ids=gen.output_ids[:k], logprobs=gen.logprobs[:k],
                                  finish_reason="stop", version=gen.version)
        return gen

    def run_tool(self, code: str) -> str:
        """Run ``code`` in the sandbox; return its stdout (and stderr when it failed)."""
        limits = SandboxLimits(cpu_s=max(1, int(self.tool_timeout_s)), wall_s=self.tool_timeout_s)
        result = run_python(code, limits)
        return result.stdout if result.passed else result.stdout + result.stderr

    def run(self, prompt: Prompt, engines: Mapping[str, Engine], sampling: SamplingParams) -> list[TrajectoryGroup]:
        eng = self.engine(engines, "policy")
        ids = prompt_ids(eng.tokenizer, prompt)
        trajs = [Trajectory(ids) for _ in range(prompt.n_samples)]
        last_text = [""] * len(trajs)
        active = list(range(len(trajs)))
        while active:
            gens = [self._cut_after_call(eng, x) for x in eng.generate([trajs[i].ids for i in active], sampling)]
            calls: dict[int, str] = {}
            for i, x in zip(active, gens):
                trajs[i].add_generation(x)
                last_text[i] = _text(eng, x.output_ids)
                code = self.tool_call(last_text[i])
                if code is not None and trajs[i].turns < self.max_turns:
                    calls[i] = code
            if calls:
                with ThreadPoolExecutor(max_workers=min(4, len(calls))) as pool:
                    outputs = dict(zip(calls, pool.map(self.run_tool, calls.values())))
                for i, out in outputs.items():
                    trajs[i].add_context(eng.tokenizer.encode(self.output_template.format(output=out),
                                                              add_special_tokens=False))
            active = sorted(calls)
        rewards = score_many(prompt, last_text)
        return [self.group(prompt, "policy", [t.to_sample(r) for t, r in zip(trajs, rewards)])]

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
import asyncio
import contextvars
import dataclasses
import hashlib
import importlib
from typing import Any, Awaitable, Callable, ClassVar, Mapping

import numpy as np

from producers.engine_batcher import EngineBatcher
from producers.engines import Engine, Generation, SamplingParams
from producers.rewards import score_many
from producers.sandbox import SandboxLimits, run_python
from topics.schemas import Prompt, Sample, TrajectoryGroup

WORKFLOWS: dict[str, type["Workflow"]] = {}
#: Workflows registered by a module of their own, imported when first asked for (it needs an optional package):
#: name -> (module, the extra that installs what it needs).
OPTIONAL_WORKFLOWS: dict[str, tuple[str, str]] = {"verifiers": ("producers.verifiers_env", "environments")}
class ServiceUnavailable(RuntimeError):
    """A service the episodes depend on (an environment server) cannot be reached: not the prompt's failure. A RaaS
    worker does not dead-letter the prompt for it; it stops (its prompts are delivered again) and is restarted,
    as for a failed engine call."""


#: A tool an episode calls: an argument (a query, code) in, the answer the agent sees out, never raising
#: for a failed tool (:class:`producers.search_tool.SearchTool`).
Tool = Callable[[str], Awaitable[str]]


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


#: modules that define built-in workflows outside this one (they import it, so they are imported on first use)
BUILTIN_WORKFLOW_MODULES = ("producers.environments", "producers.chat_server", "producers.openenv_client")


def registered_workflows(name: str | None = None) -> dict[str, type["Workflow"]]:
    """:data:`WORKFLOWS`, once the modules of the built-in workflows defined outside this one are imported
    (:data:`BUILTIN_WORKFLOW_MODULES`), and, when ``name`` is an optional workflow (:data:`OPTIONAL_WORKFLOWS`),
    its module too.

    Raises:
        ImportError: optional workflow ``name``'s package is not installed (the message names the extra).
    """
    for module in BUILTIN_WORKFLOW_MODULES:
        importlib.import_module(module)
    if name is not None and name not in WORKFLOWS and name in OPTIONAL_WORKFLOWS:
        module, extra = OPTIONAL_WORKFLOWS[name]
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ImportError(f"workflow {name!r} needs {e.name or e}: pip install 'astraflow[{extra}]'") from e
    return WORKFLOWS


def get_workflow(name: str, **config: Any) -> "Workflow":
    """Instantiate the workflow registered as ``name`` with ``config`` (``policies=...`` and options).

    Raises:
        KeyError: no workflow of that name (the message lists the known ones).
        ValueError/TypeError: a bad config (unknown role or option).
        ImportError: an optional workflow's package is not installed (the message names the extra).
    """
    workflows = registered_workflows(name)
    if name not in workflows:
        known = sorted(set(workflows) | set(OPTIONAL_WORKFLOWS))
        raise KeyError(f"unknown workflow {name!r}; registered: {known}")
    return workflows[name](**config)


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
    """One agent workflow. Subclasses set ``roles`` (role -> default policy name) and implement :meth:`rollout`.

    A workflow is a coroutine: each of the G samples of a prompt is an episode of its own (gathered
    with :func:`gather_episodes`) that awaits engine calls (:class:`~producers.engine_batcher.EngineBatcher`
    batches them with every other episode's), tool calls and other roles' turns. So an episode waiting
    on a tool or on another role holds no engine time, and a RaaS worker keeps many in flight
    (``raas.max_episodes``, :class:`~producers.raas.RaasWorker`).

    Args:
        policies: role -> policy name overrides of ``roles``.

    Raises:
        ValueError: ``policies`` names a role the workflow does not have.
    """

    name: ClassVar[str] = ""
    roles: ClassVar[dict[str, str]] = {}
    #: The tools (names in ``tools`` of :meth:`rollout`) the workflow calls; the RaaS worker provides them.
    tools: ClassVar[tuple[str, ...]] = ()

    def __init__(self, policies: Mapping[str, str] | None = None) -> None:
        unknown = set(policies or {}) - set(self.roles)
        if unknown:
            raise ValueError(f"workflow {self.name!r} has no role(s) {sorted(unknown)}; its roles are "
                             f"{sorted(self.roles)}")
        self.policies = {**self.roles, **(policies or {})}

    @abc.abstractmethod
    async def rollout(self, prompt: Prompt, engines: Mapping[str, EngineBatcher], sampling: SamplingParams,
                      tools: Mapping[str, Tool]) -> list[TrajectoryGroup]:
        """Roll out ``prompt`` G times, concurrently, and return one group per role.

        Args:
            prompt: the prompt; G is ``prompt.n_samples``.
            engines: policy name -> batcher, covering every policy in :attr:`policies`.
            sampling: sampling parameters for every generation.
            tools: tool name -> tool, covering :attr:`tools`.

        Raises:
            KeyError: no engine for a policy this workflow needs, or no tool it calls.
            GenerationInterrupted: an engine call was interrupted (the whole rollout is dropped).
            EngineCallFailed: an engine call failed (:class:`~producers.engine_batcher.EngineCallFailed`).
        """

    def run(self, prompt: Prompt, engines: Mapping[str, Engine], sampling: SamplingParams,
            tools: Mapping[str, Tool] | None = None) -> list[TrajectoryGroup]:
        """:meth:`rollout` alone, synchronously, on plain engines (its G samples still run concurrently
        and share engine calls): for evaluation, benchmarks and tests.

        Raises:
            As :meth:`rollout`.
        """
        async def one() -> list[TrajectoryGroup]:
            batchers = {p: EngineBatcher(e, name=p) for p, e in engines.items()}
            try:
                return await self.rollout(prompt, batchers, sampling, tools or {})
            finally:
                await self.close()
                for b in batchers.values():
                    b.close()
        return asyncio.run(one())

    async def close(self) -> None:
        """Release what the workflow holds in the event loop it ran in (an environment's MCP servers); the next
        rollout starts them anew. The RaaS worker calls it as it stops; :meth:`run` after each rollout."""

    def engine(self, engines: Mapping[str, EngineBatcher], role: str) -> EngineBatcher:
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


#: set by a scheduler (the RaaS worker) in a rollout's task: called once as each of its episodes ends, so the
#: scheduler counts the episodes still running (a finished one waits for its group's slowest at no cost)
episode_ended: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar("episode_ended",
                                                                                           default=None)


async def gather_episodes(episodes: list[Awaitable[Any]]) -> list[Any]:
    """:func:`asyncio.gather` of one prompt's episodes (results in order), telling the scheduler as each
    ends (:data:`episode_ended`, when set).

    Raises:
        The first error of an episode, once the others are cancelled (the prompt's rollout has failed: they
        would hold engine and tool time for nothing).
    """
    ended = episode_ended.get()

    async def episode(aw: Awaitable[Any]) -> Any:
        try:
            return await aw
        finally:
            if ended is not None:
                ended()

    tasks = [asyncio.ensure_future(episode(aw)) for aw in episodes]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


async def rewards_of(prompt: Prompt, completions: list[str]) -> list[float]:
    """:func:`producers.rewards.score_many` off the event loop (a reward may run a sandbox or a process)."""
    return await asyncio.to_thread(score_many, prompt, completions)


def group_id_for(prompt: Prompt, policy: str, role: str) -> str:
    """The de-duplication key of the group ``role`` (played by ``policy``) makes for one delivery of
    ``prompt``: sha256 of (prompt_id, epoch, policy, role), 32 hex characters. A redelivered prompt
    (a RaaS worker crashed before its commit) gets the same ids, which the serving stage de-duplicates;
    the next epoch's rollout of the prompt gets new ones."""
    key = f"{prompt.prompt_id}\x00{prompt.metadata.get('epoch', 0)}\x00{policy}\x00{role}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


@register_workflow("single_turn")
class SingleTurn(Workflow):
    """G samples of one answer each; reward from :func:`producers.rewards.score_many`. The G requests (and
    those of every other prompt in flight) share engine calls; the engine prefills each distinct prompt once."""

    roles: ClassVar[dict[str, str]] = {"policy": "actor"}

    async def rollout(self, prompt: Prompt, engines: Mapping[str, EngineBatcher], sampling: SamplingParams,
                      tools: Mapping[str, Tool]) -> list[TrajectoryGroup]:
        eng = self.engine(engines, "policy")
        ids = prompt_ids(eng.tokenizer, prompt)
        gens = await eng.generate_many([ids] * prompt.n_samples, sampling)
        rewards = await rewards_of(prompt, [_text(eng, g.output_ids) for g in gens])
        trajs = [Trajectory(ids) for _ in gens]
        for t, g in zip(trajs, gens):
            t.add_generation(g)
        return [self.group(prompt, "policy", [t.to_sample(r) for t, r in zip(trajs, rewards)])]


def accepts(verdict: str) -> bool:
    """The verdict parse rule: the first non-space character is ``1``, ``y`` or ``Y``."""
    text = verdict.lstrip()
    return bool(text) and text[0] in "1yY"


def _budget(sampling: SamplingParams, max_new_tokens: int | None) -> SamplingParams:
    """``sampling`` with another token budget (unchanged when ``max_new_tokens`` is None)."""
    return sampling if max_new_tokens is None else dataclasses.replace(sampling, max_new_tokens=max_new_tokens)


@register_workflow("solve_verify_retry")
class SolveVerifyRetry(Workflow):
    """Solver answers, verifier judges, and a rejected answer is retried once with the verifier's text.

    Per sample (an episode of its own: one sample's verifier turn does not wait for the other
    samples' solvers): the solver answers the prompt; the verifier sees ``verifier_template`` filled
    with the problem and that answer, and its verdict is parsed by :func:`accepts`. If it rejects,
    ``retry_template`` (with the verdict text) is appended to the solver's trajectory as context and
    the solver answers again.

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

    async def _episode(self, prompt: Prompt, solver: EngineBatcher, verifier: EngineBatcher, ids: list[int],
                       sampling: SamplingParams) -> tuple[Trajectory, Trajectory, str, str, bool]:
        """One sample: (solver trajectory, verifier trajectory, first answer, final answer, accepted)."""
        sol = Trajectory(ids)
        first = await solver.generate(ids, sampling)
        sol.add_generation(first)
        answer = _text(solver, first.output_ids)
        ver = Trajectory(prompt_ids(verifier.tokenizer, self.verifier_template.format(
            problem=problem_text(prompt), answer=answer)))
        verdict = await verifier.generate(ver.ids, _budget(sampling, self.verifier_max_new_tokens))
        ver.add_generation(verdict)
        verdict_text = _text(verifier, verdict.output_ids)
        final = answer
        if not accepts(verdict_text):
            feedback = self.retry_template.format(verdict=verdict_text.strip())
            sol.add_context(solver.tokenizer.encode(feedback, add_special_tokens=False))
            second = await solver.generate(sol.ids, sampling)
            sol.add_generation(second)
            final = _text(solver, second.output_ids)
        return sol, ver, answer, final, accepts(verdict_text)

    async def rollout(self, prompt: Prompt, engines: Mapping[str, EngineBatcher], sampling: SamplingParams,
                      tools: Mapping[str, Tool]) -> list[TrajectoryGroup]:
        solver, verifier = self.engine(engines, "solver"), self.engine(engines, "verifier")
        ids = prompt_ids(solver.tokenizer, prompt)
        episodes = await gather_episodes([self._episode(prompt, solver, verifier, ids, sampling)
                                          for _ in range(prompt.n_samples)])
        sol, ver, answers, final, accepted = map(list, zip(*episodes))
        correct = [r > 0.5 for r in await rewards_of(prompt, answers)]
        solver_rewards = await rewards_of(prompt, final)
        verifier_rewards = [float(a == c) for a, c in zip(accepted, correct)]
        return [self.group(prompt, "solver", [t.to_sample(r) for t, r in zip(sol, solver_rewards)]),
                self.group(prompt, "verifier", [t.to_sample(r) for t, r in zip(ver, verifier_rewards)])]


@register_workflow("plan_execute_critique")
class PlanExecuteCritique(Workflow):
    """Three roles: a planner writes a plan, an executor answers following it, a critic judges the answer.

    Per sample (an episode of its own): the planner sees ``planner_template`` (with ``{problem}``) and
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

    async def _episode(self, prompt: Prompt, engines: Mapping[str, EngineBatcher],
                       sampling: SamplingParams) -> tuple[Trajectory, Trajectory, Trajectory, str, str]:
        """One sample: (plan, executor and critic trajectories, the answer, the verdict)."""
        planner, executor = self.engine(engines, "planner"), self.engine(engines, "executor")
        critic, problem = self.engine(engines, "critic"), problem_text(prompt)
        plan = Trajectory(prompt_ids(planner.tokenizer, self.planner_template.format(problem=problem)))
        x = await planner.generate(plan.ids, _budget(sampling, self.plan_max_new_tokens))
        plan.add_generation(x)
        plan_text = _text(planner, x.output_ids).strip()
        exe = Trajectory(prompt_ids(executor.tokenizer, self.executor_template.format(plan=plan_text,
                                                                                       problem=problem)))
        x = await executor.generate(exe.ids, sampling)
        exe.add_generation(x)
        answer = _text(executor, x.output_ids)
        crit = Trajectory(prompt_ids(critic.tokenizer, self.critic_template.format(
            problem=problem, plan=plan_text, answer=answer)))
        x = await critic.generate(crit.ids, _budget(sampling, self.critic_max_new_tokens))
        crit.add_generation(x)
        return plan, exe, crit, answer, _text(critic, x.output_ids)

    async def rollout(self, prompt: Prompt, engines: Mapping[str, EngineBatcher], sampling: SamplingParams,
                      tools: Mapping[str, Tool]) -> list[TrajectoryGroup]:
        episodes = await gather_episodes([self._episode(prompt, engines, sampling) for _ in range(prompt.n_samples)])
        plans, exes, crits, answers, verdicts = map(list, zip(*episodes))
        outcome = await rewards_of(prompt, answers)
        critic_rewards = [float(accepts(v) == (c > 0.5)) for v, c in zip(verdicts, outcome)]
        return [self.group(prompt, "planner", [t.to_sample(r) for t, r in zip(plans, outcome)]),
                self.group(prompt, "executor", [t.to_sample(r) for t, r in zip(exes, outcome)]),
                self.group(prompt, "critic", [t.to_sample(r) for t, r in zip(crits, critic_rewards)])]


class ToolLoop(Workflow):
    """An agent loop over one tool: each model turn's output is cut just after the first complete call
    (``tool_open`` ... ``tool_close``; the tokens kept are a prefix of what was sampled, so their logprobs
    stay exact), the tool runs, and its answer is appended in ``output_template`` as context (loss_mask
    0); the sample then takes another turn, up to ``max_turns`` model turns. A turn without a complete
    call ends the episode. The reward is the score of the last model turn's text.

    Each sample is an episode of its own: while one waits for its tool, the others generate. Subclasses
    implement :meth:`call_tool`, which returns the tool's answer as text and never raises for a failed
    tool (a failure is an observation the agent sees).

    Args:
        policies: role overrides; role ``policy``.
        max_turns: the most model turns per sample (>= 1).
        tool_open, tool_close: the tool-call delimiters.
        output_template: format string with ``{output}`` for the tool turn.

    Raises:
        ValueError: ``max_turns`` < 1.
    """

    roles: ClassVar[dict[str, str]] = {"policy": "actor"}

    def __init__(self, policies: Mapping[str, str] | None, max_turns: int, tool_open: str, tool_close: str,
                 output_template: str) -> None:
        super().__init__(policies)
        if max_turns < 1:
            raise ValueError(f"{self.name} max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        self.tool_open, self.tool_close = tool_open, tool_close
        self.output_template = output_template

    def tool_call(self, text: str) -> str | None:
        """The argument of the first complete tool call in ``text``, or None."""
        start = text.find(self.tool_open)
        if start < 0:
            return None
        end = text.find(self.tool_close, start + len(self.tool_open))
        return None if end < 0 else text[start + len(self.tool_open):end]

    def _cut_after_call(self, engine: EngineBatcher, gen: Generation) -> Generation:
        """``gen`` cut just after its first complete tool call (unchanged when it has none)."""
        text = _text(engine, gen.output_ids)
        if self.tool_call(text) is None:
            return gen
        for k in range(1, len(gen.output_ids) + 1):
            if self.tool_call(_text(engine, gen.output_ids[:k])) is not None:
                return Generation(output_ids=gen.output_ids[:k], logprobs=gen.logprobs[:k],
                                  finish_reason="stop", version=gen.version)
        return gen

    @abc.abstractmethod
    async def call_tool(self, argument: str, tools: Mapping[str, Tool]) -> str:
        """The tool's answer to ``argument`` (an error is an answer too: it never raises for a failed tool)."""

    async def _episode(self, eng: EngineBatcher, ids: list[int], sampling: SamplingParams,
                       tools: Mapping[str, Tool]) -> tuple[Trajectory, str]:
        """One sample: its trajectory and its last model turn's text."""
        traj, text = Trajectory(ids), ""
        while True:
            gen = self._cut_after_call(eng, await eng.generate(traj.ids, sampling))
            traj.add_generation(gen)
            text = _text(eng, gen.output_ids)
            argument = self.tool_call(text)
            if argument is None or traj.turns >= self.max_turns:
                return traj, text
            output = await self.call_tool(argument, tools)
            traj.add_context(eng.tokenizer.encode(self.output_template.format(output=output),
                                                  add_special_tokens=False))

    async def rollout(self, prompt: Prompt, engines: Mapping[str, EngineBatcher], sampling: SamplingParams,
                      tools: Mapping[str, Tool]) -> list[TrajectoryGroup]:
        eng = self.engine(engines, "policy")
        ids = prompt_ids(eng.tokenizer, prompt)
        episodes = await gather_episodes([self._episode(eng, ids, sampling, tools) for _ in range(prompt.n_samples)])
        rewards = await rewards_of(prompt, [text for _, text in episodes])
        return [self.group(prompt, "policy", [t.to_sample(r) for (t, _), r in zip(episodes, rewards)])]


@register_workflow("multi_turn")
class MultiTurn(ToolLoop):
    """A Python tool loop (:class:`ToolLoop`): code between ``tool_open`` and ``tool_close`` runs in the
    sandbox (:func:`producers.sandbox.run_python`, on a thread: the other episodes go on), and its stdout,
    plus stderr when the run failed, is the tool's answer.

    Args:
        policies: role overrides; role ``policy``.
        max_turns: the most model turns per sample.
        tool_open, tool_close: the tool-call delimiters.
        output_template: format string with ``{output}`` for the tool turn.
        tool_timeout_s: wall-clock limit of one tool run, seconds (CPU limit: its ceiling).
    """

    def __init__(self, policies: Mapping[str, str] | None = None, max_turns: int = 3,
                 tool_open: str = "<python>", tool_close: str = "</python>",
                 output_template: str = "\n<output>\n{output}</output>\n", tool_timeout_s: float = 5.0) -> None:
        super().__init__(policies, max_turns, tool_open, tool_close, output_template)
        self.tool_timeout_s = tool_timeout_s

    def run_tool(self, code: str) -> str:
        """Run ``code`` in the sandbox; return its stdout (and stderr when it failed)."""
        limits = SandboxLimits(cpu_s=max(1, int(self.tool_timeout_s)), wall_s=self.tool_timeout_s)
        result = run_python(code, limits)
        return result.stdout if result.passed else result.stdout + result.stderr

    async def call_tool(self, argument: str, tools: Mapping[str, Tool]) -> str:
        return await asyncio.to_thread(self.run_tool, argument)


@register_workflow("search_agent")
class SearchAgent(ToolLoop):
    """A search agent (:class:`ToolLoop`): the text between ``<search>`` and ``</search>`` is a query to the
    ``search`` tool (a retrieval service, :mod:`producers.search_tool`; config ``tools.search``), whose
    answer (the top documents, or ``error: ...`` when the service failed or timed out) comes back in
    ``output_template``. The answer turn follows; the reward is the score of the last model turn.

    Args:
        policies: role overrides; role ``policy``.
        max_turns: the most model turns per sample (searches are at most ``max_turns - 1``).
        tool_open, tool_close: the call delimiters.
        output_template: format string with ``{output}`` for the tool's answer.
    """

    tools: ClassVar[tuple[str, ...]] = ("search",)

    def __init__(self, policies: Mapping[str, str] | None = None, max_turns: int = 2,
                 tool_open: str = "<search>", tool_close: str = "</search>",
                 output_template: str = "\n<result>{output}</result>\n") -> None:
        super().__init__(policies, max_turns, tool_open, tool_close, output_template)

    async def call_tool(self, argument: str, tools: Mapping[str, Tool]) -> str:
        if "search" not in tools:
            raise KeyError(f"workflow {self.name!r} calls the search tool, and none is configured (tools.search)")
        return await tools["search"](argument)

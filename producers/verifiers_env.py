"""The ``verifiers`` workflow: a locally installed verifiers (``verifiers.v1``, 0.4) environment in RaaS episodes.

verifiers runs each episode as ``Env.run_episode(task, ctx)``: an agent (a *harness* in a *runtime*) talks to the
model through verifiers' loopback interception server, which forwards each request to the OpenAI-compatible
``base_url`` of ``ctx.client`` with the trace id in the ``X-Session-ID`` header; the task's ``@vf.reward``
functions (and plugged judges) then score the trace. Here that ``base_url`` is the worker's
:class:`~producers.chat_server.ChatServer`, so each trace is one recorded session: its token ids, behaviour
logprobs and weight versions are the sample, and ``trace.reward`` its reward.

Every built-in verifiers harness runs a program that needs the network or a container (``uv`` resolves the chat
program's PyPI dependencies; the others are marked ``NEEDS_CONTAINER``), so the episode's agent is
:class:`LoopbackChatHarness`: a chat loop in the worker's event loop (the in-process form verifiers' ``Harness.launch``
contract allows), over the subprocess runtime. It offers the env module's ``TOOLS`` (typed functions or
:func:`producers.environments.run_tool` tools over the run's configured tools) as OpenAI tools and answers the
model's ``tool_calls`` with them.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Mapping

import verifiers.v1 as vf
from pydantic import Field
from verifiers.v1.configs.agent import agent_config_fields
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult

from policies.registry import import_user_module
from producers.chat_server import ChatEndpointWorkflow, ChatServer
from producers.engine_batcher import EngineBatcher
from producers.engines import SamplingParams
from producers.environments import Environment, ToolCall, current_run_tools
from producers.workflows import Tool, Trajectory, gather_episodes, register_workflow
from topics.schemas import Prompt, Sample, TrajectoryGroup

#: The harness id verifiers resolves to :class:`LoopbackChatHarness` (it imports a harness id as a module name).
HARNESS_ID = "astraflow_loopback_chat"
#: The tools the episodes of this context offer (:class:`VerifiersWorkflow` sets it for its rollout's episodes).
episode_tools: contextvars.ContextVar[Environment] = contextvars.ContextVar("episode_tools", default=Environment())
#: The environment variable verifiers reads the endpoint's API key from (the endpoint takes any key).
API_KEY_VAR = "ASTRAFLOW_CHAT_API_KEY"


class LoopbackChatHarnessConfig(vf.HarnessConfig):
    """:class:`LoopbackChatHarness`'s config: ``max_turns`` model turns per episode at most."""

    id: str = HARNESS_ID
    max_turns: int = Field(4, ge=1)


class LoopbackChatHarness(vf.Harness[LoopbackChatHarnessConfig]):
    """A chat loop in the calling event loop: the task's prompt (and system prompt), then model turns through the
    interception ``endpoint``, each turn's ``tool_calls`` answered by :data:`episode_tools` as ``tool`` messages,
    until a turn without calls or ``max_turns`` turns. Needs no program, network or container; serves no MCP tool
    servers (verifiers refuses a task with toolsets for it)."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: Any, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: vf.TaskData) -> ProgramResult:
        import openai

        tools = episode_tools.get()
        schemas = tools.tool_schemas()
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(m) for m in prompt or ()]
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            for _ in range(self.config.max_turns):
                reply = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                             **({"tools": schemas} if schemas else {}))
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    try:
                        arguments = json.loads(call.function.arguments or "{}")
                    except ValueError as e:
                        answer = f"error: the arguments of {call.function.name} are not JSON: {e}"
                    else:
                        answer = await tools.call_tool(ToolCall(call.function.name, arguments, call.id))
                    messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                                     "content": answer})
        finally:
            await client.close()
        return ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["LoopbackChatHarness", "LoopbackChatHarnessConfig", "VerifiersWorkflow"]
sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])


def import_env_module(env: str) -> tuple[str, Any]:
    """The verifiers taskset id and module of ``env``: an installed module name (from ``sys.path`` or, last, the
    working directory), or a ``.py`` file (imported under its stem, the id verifiers then resolves it by).

    Raises:
        ValueError: the module or file cannot be imported (missing, or it raised as it was imported), or another
            module already has the file's name.
    """
    try:
        if not env.endswith(".py"):
            return env, import_user_module(env.replace("-", "_"))
        path = Path(env).resolve()
        name = path.stem
        loaded = sys.modules.get(name)
        if loaded is not None:
            if Path(getattr(loaded, "__file__", "") or "").resolve() != path:
                raise ValueError(f"a module named {name!r} is already imported from {loaded.__file__}; rename "
                                 f"{path}")
            return name, loaded
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"no such file {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return name, module
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001  a module that raises as it is imported, whatever it raises
        raise ValueError(f"cannot import {env!r}: {type(e).__name__}: {e}") from None


@register_workflow("verifiers")
class VerifiersWorkflow(ChatEndpointWorkflow):
    """Runs a verifiers environment (module docstring): each sample is one episode of the env on a task made from
    the prompt, one trace, one session of the worker's endpoint.

    The task is of the taskset's task type, its data built from the prompt: ``prompt`` is the prompt's messages
    (or its text), ``id`` its ``prompt_id``, and each other field the data type declares is taken from the
    prompt's attribute of that name (``answer``, ``tests``, ``entry_point``) or else from its ``metadata``. The
    sample is the session's last trajectory; its reward is the trace's (``trace.reward``: the weighted sum of the
    task's rewards and judges).

    Args:
        policies: role overrides; role ``policy``.
        env: the env: an installed taskset module (``my_env`` or ``my-env``) or a ``.py`` file of one.
        env_args: the taskset config's fields (``--env.taskset.*``).
        max_turns: the most model turns per episode.
        timeout_s: an episode's deadline, seconds (verifiers' ``timeout.episode``): past it the episode fails.
        parser: the tool-call parser of the endpoint's replies.

    Raises:
        ValueError: ``env`` cannot be loaded, is not a single-agent env, its config refuses ``env_args``, or a
            bad ``max_turns``/``timeout_s``.
        KeyError: an unknown parser.
    """

    def __init__(self, policies: Mapping[str, str] | None = None, env: str | None = None,
                 env_args: Mapping[str, Any] | None = None, max_turns: int = 4, timeout_s: float = 600.0,
                 parser: str = "hermes") -> None:
        super().__init__(policies, parser)
        if env is None:
            raise ValueError("workflow verifiers: options.env is required (a taskset module or a .py file)")
        if max_turns < 1:
            raise ValueError(f"workflow verifiers: options.max_turns must be >= 1, got {max_turns}")
        if not timeout_s > 0:
            raise ValueError(f"workflow verifiers: options.timeout_s must be > 0, got {timeout_s}")
        try:
            taskset_id, module = import_env_module(env)
        except ValueError as e:
            raise ValueError(f"workflow verifiers: options.env: {e}") from None
        try:
            config = vf.resolve_env_config({"taskset": {"id": taskset_id, **(env_args or {})}})
        except Exception as e:  # noqa: BLE001  verifiers' own errors (validation, plugin lookup), named
            raise ValueError(f"workflow verifiers: options.env {env!r} with env_args {dict(env_args or {})}: "
                             f"{type(e).__name__}: {e}") from None
        seats = list(agent_config_fields(config))
        if len(seats) != 1:
            raise ValueError(f"workflow verifiers: options.env {env!r} has the agent seats {seats}; one seat, one "
                             "session per episode, is what a sample is")
        # the seat's own settings stay; the policy plays it, through the loopback chat loop on the host
        seat = getattr(config, seats[0]).model_copy(update={
            "harness": LoopbackChatHarnessConfig(max_turns=max_turns), "runtime": vf.SubprocessConfig(),
            "model": None, "client": None})
        self.env_config = config.model_copy(update={
            seats[0]: seat, "timeout": config.timeout.model_copy(update={"episode": float(timeout_s)})})
        self.task_type = vf.load_taskset(config.taskset).task_type()
        #: the env module's ``TOOLS``, offered to the model
        self.env_tools = Environment(tools=getattr(module, "TOOLS", ()))
        #: the run's configured tools they call: the RaaS worker refuses a config without them
        self.tools = tuple(t.run_tool for t in self.env_tools.tools.values() if t.run_tool)
        self._env: tuple[asyncio.AbstractEventLoop, vf.Env, contextlib.AsyncExitStack] | None = None
        self._env_starting: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    async def _serving(self) -> vf.Env:
        """The env, serving (its interception server and shared resources up), once per event loop."""
        loop = asyncio.get_running_loop()
        if self._env_starting is None or self._env_starting[0] is not loop:
            self._env_starting = (loop, asyncio.Lock())
        async with self._env_starting[1]:  # the rollouts of a worker's first prompts all ask at once
            if self._env is None or self._env[0] is not loop:
                env = vf.load_environment(self.env_config)
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(env.serving())
                self._env = (loop, env, stack)
        return self._env[1]

    async def close(self) -> None:
        """Stop the env's serving resources and the endpoint."""
        if self._env is not None:
            env, self._env = self._env, None
            await env[2].aclose()
        await super().close()

    def task(self, prompt: Prompt) -> vf.Task:
        """The task of ``prompt`` (class docstring).

        Raises:
            ValueError: the prompt lacks a field the task's data requires (the message names it).
        """
        data_type = self.task_type.data_type()
        fields: dict[str, Any] = {"prompt": prompt.messages or prompt.text, "id": prompt.prompt_id}
        for name in data_type.model_fields:
            if name in fields or name == "idx":
                continue
            value = getattr(prompt, name, None) if name in Prompt.model_fields else None
            if value is None:
                value = prompt.metadata.get(name)
            if value is not None:
                fields[name] = value
        try:
            return self.task_type(data_type.model_validate(fields))
        except Exception as e:  # noqa: BLE001  pydantic's message names the field
            raise ValueError(f"prompt {prompt.prompt_id}: not a {data_type.__name__}: {e}") from None

    async def _episode(self, env: vf.Env, server: ChatServer, task: vf.Task) -> Sample:
        """One sample: one episode of ``task``, its trace's session scored with the trace's reward.

        Raises:
            GenerationInterrupted, EngineCallFailed: a model call of the episode met one.
            ValueError: the episode failed (verifiers' errors, named), or never called the model.
        """
        client = vf.EvalClientConfig(base_url=server.url, api_key_var=API_KEY_VAR)
        episode = await env.run_episode(task, vf.ModelContext(model=server.model, client=client),
                                        on_discard=lambda trace: server.pop_session(trace.id))
        sessions = [server.pop_session(t.id) for t in episode.traces]
        for session in sessions:
            if session.failure is not None:  # an interrupted or failed engine call stays what it is
                raise session.failure
        if not episode.ok:
            errors = [e for t in episode.traces for e in t.errors] + list(episode.errors)
            reasons = "; ".join(f"{e.type}: {e.message}" for e in errors) or "no error recorded"
            raise ValueError(f"the verifiers episode failed: {reasons}")
        [trace], [session] = episode.traces, sessions
        if not session.trajectories:
            raise ValueError("the verifiers episode never called the model")
        trajectory: Trajectory = session.trajectories[-1]
        return trajectory.to_sample(trace.reward)

    async def rollout(self, prompt: Prompt, engines: Mapping[str, EngineBatcher], sampling: SamplingParams,
                      tools: Mapping[str, Tool]) -> list[TrajectoryGroup]:
        server = await self._endpoint(self.engine(engines, "policy"), sampling)
        env = await self._serving()
        task = self.task(prompt)
        current_run_tools.set(tools)
        episode_tools.set(self.env_tools)
        samples = await gather_episodes([self._episode(env, server, task) for _ in range(prompt.n_samples)])
        return [self.group(prompt, "policy", samples)]

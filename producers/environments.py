"""Bring-your-own environments: typed tools, named tool-call parsers, rubrics, and the ``environment`` workflow.

An :class:`Environment` is what an agent task needs beyond the model: the tools the model may call (declared
as OpenAI function-call JSON schemas, derived from typed Python functions by :func:`function_tool`, listed from
an MCP server by :class:`producers.mcp_tools.MCPServer`, or the run's configured tools by :func:`run_tool`), how
a model turn is read (a tool-call parser by name, :data:`TOOL_PARSERS`: ``hermes``), what the environment
answers (:meth:`Environment.env_response`: by default the tool results, as ``tool`` messages), when an episode
ends, and how it is scored (a :class:`Rubric`, a weighted sum of reward functions).

It maps onto the frameworks users bring environments from: a verifiers ``ToolEnv``/``MultiTurnEnv`` is tools,
a parser, ``env_response``/``is_completed`` and a rubric; an OpenEnv environment's ``step(action)`` is an
``env_response`` that returns the observation as a message and puts the step's reward and ``done`` in the
episode's ``state`` (the ``openenv`` workflow, :mod:`producers.openenv_client`).

The ``environment`` workflow (:class:`EnvironmentWorkflow`) runs one in RaaS episodes. Each sample is a chat:
the prompt's messages (after the environment's system prompt) are rendered with the policy's chat template and
the tool schemas (``tokenizer.apply_chat_template(messages, tools=...)``); each model turn is sampled with the
parser's stop strings (``</tool_call>``), so a turn ends at its call (an environment with ``parallel_tool_calls``
samples its turns without them and runs every call of a turn concurrently); the environment's answer is appended as
the chat template renders it after an assistant turn (the *rendered delta*: only the new turns are tokenized,
so the tokens of earlier turns are never re-tokenized and every generated token keeps its behaviour logprob and
version); tool turns have ``loss_mask`` 0. An episode is a coroutine of the workflow like any other, so it is
interruptible, waits on tools without holding the engine, and counts toward ``raas.max_episodes``.
"""
from __future__ import annotations

import abc
import asyncio
import collections
import contextvars
import dataclasses
import importlib.util
import inspect
import json
import logging
import re
import sys
import threading
from pathlib import Path
from typing import Any, Awaitable, Callable, ClassVar, Mapping, Sequence

import docstring_parser
from pydantic import TypeAdapter, ValidationError, validate_call

from policies.registry import import_user_module
from producers.engine_batcher import EngineBatcher
from producers.engines import SamplingParams
from producers.workflows import (Tool, Trajectory, Workflow, gather_episodes, register_workflow,
                                 rewards_of)
from topics.schemas import Prompt, TrajectoryGroup

log = logging.getLogger(__name__)
_logged_tools: set[str] = set()  # tools whose first failed call in this process was logged

#: The run's configured tools (``tools:`` of the config) while a rollout of :class:`EnvironmentWorkflow` runs;
#: :func:`run_tool` calls them.
current_run_tools: contextvars.ContextVar[Mapping[str, Tool]] = contextvars.ContextVar("current_run_tools",
                                                                                       default={})


@dataclasses.dataclass(frozen=True)
class FunctionTool:
    """A tool the model calls by name with JSON arguments.

    Attributes:
        name: the function name the model calls.
        description: what the tool does (the model reads it).
        parameters: the arguments' JSON schema (an ``object`` schema).
        call: ``await call(arguments)`` -> the text the model sees; may raise (:meth:`Environment.call_tool`
            turns an error into an ``error: ...`` observation).
        run_tool: the run's configured tool it calls (:func:`run_tool`), if any: the run must configure it.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    call: Callable[[dict[str, Any]], Awaitable[str]]
    run_tool: str | None = None

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-call schema ``{"type": "function", "function": {name, description, parameters}}``,
        the form ``apply_chat_template(tools=...)`` and ``/v1/chat/completions`` take."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def _drop_titles(schema: Any) -> Any:
    """``schema`` without pydantic's generated ``title`` keys (noise to a model), recursively."""
    if isinstance(schema, dict):
        return {k: _drop_titles(v) for k, v in schema.items()
                if not (k == "title" and isinstance(v, str))}
    if isinstance(schema, list):
        return [_drop_titles(v) for v in schema]
    return schema


def function_tool(fn: Callable[..., Any], name: str | None = None) -> FunctionTool:
    """A :class:`FunctionTool` from a typed Python function (sync or async) returning the answer text.

    The parameters' JSON schema is pydantic's (``TypeAdapter(fn).json_schema()``: types from the type hints,
    defaults, ``Literal`` enums, nested models); the description and each parameter's description come from
    the docstring (Google, reST or NumPy style, by ``docstring_parser``). Arguments are validated (and coerced)
    by ``pydantic.validate_call`` before the call; a sync function runs on a thread so the other episodes go on.
    A non-string result is sent as JSON.

    Raises:
        TypeError: ``fn`` has ``*args``/``**kwargs`` or a parameter without a type hint (its schema would be
            empty); or pydantic cannot build a schema for a hint.
    """
    sig = inspect.signature(fn)
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"tool {fn.__name__}: *args/**kwargs cannot be described to a model")
        if p.annotation is inspect.Parameter.empty:
            raise TypeError(f"tool {fn.__name__}: parameter {p.name!r} has no type hint")
    schema = _drop_titles(TypeAdapter(fn).json_schema())
    doc = docstring_parser.parse(inspect.getdoc(fn) or "")
    for param in doc.params:
        if param.arg_name in schema.get("properties", {}) and param.description:
            schema["properties"][param.arg_name]["description"] = param.description
    description = "\n\n".join(d for d in (doc.short_description, doc.long_description) if d)
    validated = validate_call(fn)
    is_async = inspect.iscoroutinefunction(fn)

    async def call(arguments: dict[str, Any]) -> str:
        try:
            result = await validated(**arguments) if is_async else await asyncio.to_thread(validated, **arguments)
        except SystemExit as e:  # out of this coroutine, it would leave the event loop and end the worker
            raise RuntimeError(f"the tool raised SystemExit({e.code!r})") from None
        return result if isinstance(result, str) else json.dumps(result)

    return FunctionTool(name=name or fn.__name__, description=description, parameters=schema, call=call)


def run_tool(name: str, description: str, argument: str = "query",
             argument_description: str | None = None) -> FunctionTool:
    """A :class:`FunctionTool` over the run's configured tool ``name`` (config ``tools.<name>``, e.g. the
    built-in ``search``), with one string argument ``argument``; looked up at call time in the rollout's
    :data:`current_run_tools`.

    Raises (at call time):
        KeyError: the run configures no tool ``name`` (the message names the field ``tools.<name>``).
    """
    prop: dict[str, Any] = {"type": "string"}
    if argument_description:
        prop["description"] = argument_description

    async def call(arguments: dict[str, Any]) -> str:
        tools = current_run_tools.get()
        if name not in tools:
            raise KeyError(f"the environment calls the run's tool {name!r}, and the config does not configure it "
                           f"(tools.{name}; configured: {sorted(tools) or 'none'})")
        value = arguments.get(argument)
        if not isinstance(value, str):
            raise ValueError(f"argument {argument!r} must be a string, got {type(value).__name__}")
        return await tools[name](value)

    return FunctionTool(name=name, description=description,
                        parameters={"type": "object", "properties": {argument: prop}, "required": [argument]},
                        call=call, run_tool=name)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call the model made: ``name``, ``arguments`` (decoded JSON object) and an id unique in its episode."""

    name: str
    arguments: dict[str, Any]
    id: str

    def message(self) -> dict[str, Any]:
        """The call in an assistant message's ``tool_calls`` (OpenAI form; ``arguments`` left a dict, as chat
        templates render it)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """A model turn read by a :class:`ToolParser`: ``content`` (text outside the calls), ``calls``, and
    ``errors`` (one text per malformed call, answered to the model as a tool result)."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()

    def message(self) -> dict[str, Any]:
        """The turn as an assistant chat message (``tool_calls`` only when it made some)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            msg["tool_calls"] = [c.message() for c in self.calls]
        return msg


class ToolParser(abc.ABC):
    """Reads tool calls out of a model turn's text. Registered by name in :data:`TOOL_PARSERS`
    (``@register_tool_parser("name")``).

    Attributes:
        stop: strings that end a turn at its call (``SamplingParams.stop``): generation stops as a call closes,
            so no tokens are sampled past it.
    """

    name: ClassVar[str] = ""
    stop: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def parse(self, text: str, first_id: int = 0) -> ParsedTurn:
        """The content and calls of ``text``; calls get ids ``call_<first_id>``, ``call_<first_id + 1>``, ..."""

    def read(self, text: str, first_id: int = 0) -> ParsedTurn:
        """:meth:`parse` a model turn, counting its malformed calls in :func:`environment_errors` (what every
        workflow calls)."""
        turn = self.parse(text, first_id)
        _count("tool_parse_errors", len(turn.errors))
        return turn


_errors: collections.Counter[str] = collections.Counter()  # kind -> count in this process (environment_errors)
_errors_lock = threading.Lock()


def _count(kind: str, n: int = 1) -> None:
    with _errors_lock:
        _errors[kind] += n


def environment_errors() -> dict[str, int]:
    """What went wrong in this process's episodes and was answered to the model as an error (the episode went
    on): ``tool_parse_errors``, malformed tool calls (:meth:`ToolParser.read`), and ``tool_call_errors``, calls of
    an environment's tools that failed (:meth:`Environment.call_tool`: an unknown tool, bad arguments, a tool
    that raised or did not answer in ``tool_timeout_s``). A RaaS worker reports each as ``<kind>_total`` on
    ``metrics``."""
    with _errors_lock:
        return {kind: _errors[kind] for kind in ("tool_parse_errors", "tool_call_errors")}


TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """Class decorator adding a :class:`ToolParser` to :data:`TOOL_PARSERS` under ``name``.

    Raises:
        ValueError: ``name`` is already registered.
    """
    def deco(cls: type[ToolParser]) -> type[ToolParser]:
        if name in TOOL_PARSERS:
            raise ValueError(f"tool parser {name!r} is already registered (by {TOOL_PARSERS[name].__name__})")
        cls.name = name
        TOOL_PARSERS[name] = cls
        return cls
    return deco


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name``.

    Raises:
        KeyError: no parser of that name (the message lists the known ones).
    """
    if name not in TOOL_PARSERS:
        raise KeyError(f"unknown tool parser {name!r}; registered: {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


@register_tool_parser("hermes")
class HermesParser(ToolParser):
    """The Hermes/Qwen2.5 format: each call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
    in the assistant's text (what Qwen2.5's and Hermes' chat templates render and their models emit). A call
    whose body is not a JSON object with a string ``name`` and an object ``arguments`` is an error the model
    is told about."""

    stop: ClassVar[tuple[str, ...]] = ("</tool_call>",)
    CALL: ClassVar[re.Pattern[str]] = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, first_id: int = 0) -> ParsedTurn:
        calls: list[ToolCall] = []
        errors: list[str] = []
        for match in self.CALL.finditer(text):
            body = match.group(1).strip()
            try:
                obj = json.loads(body)
                if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                    raise ValueError('not an object with a string "name"')
                args = obj.get("arguments", {})
                if isinstance(args, str):  # some models send the arguments JSON-encoded, as the OpenAI API does
                    args = json.loads(args)
                if not isinstance(args, dict):
                    raise ValueError('"arguments" is not an object')
            except ValueError as e:
                errors.append(f"error: malformed tool call {body[:200]!r}: {e}")
                continue
            calls.append(ToolCall(name=obj["name"], arguments=args, id=f"call_{first_id + len(calls)}"))
        content = self.CALL.sub("", text).strip() if (calls or errors) else text
        return ParsedTurn(content=content, calls=tuple(calls), errors=tuple(errors))


RewardFn = Callable[..., float | Awaitable[float]]
#: The keyword arguments a reward function may declare (it gets those it names).
REWARD_ARGUMENTS = ("prompt", "completion", "messages", "answer", "state")


class Rubric:
    """A weighted sum of reward functions: ``reward = sum_i w_i * f_i(...)`` (verifiers' ``Rubric``).

    Each function (sync or async) declares the keyword arguments it needs among :data:`REWARD_ARGUMENTS`:
    ``prompt`` (the :class:`~topics.schemas.Prompt`), ``completion`` (the messages after the prompt's),
    ``messages`` (all of them), ``answer`` (``prompt.answer``) and ``state`` (the episode's dict).

    Args:
        funcs: reward functions, or ``(function, weight)`` pairs (weight 1.0 when not given).

    Raises:
        TypeError: a function declares an argument not in :data:`REWARD_ARGUMENTS`.
    """

    def __init__(self, funcs: Sequence[RewardFn | tuple[RewardFn, float]] = ()) -> None:
        self.funcs: list[tuple[RewardFn, float]] = [f if isinstance(f, tuple) else (f, 1.0) for f in funcs]
        for fn, _ in self.funcs:
            unknown = set(inspect.signature(fn).parameters) - set(REWARD_ARGUMENTS)
            if unknown:
                raise TypeError(f"reward function {getattr(fn, '__name__', fn)!r} takes {sorted(unknown)}; "
                                f"a reward function may take {list(REWARD_ARGUMENTS)}")

    async def score(self, prompt: Prompt, messages: list[dict[str, Any]], n_prompt: int,
                    state: dict[str, Any]) -> tuple[float, dict[str, float]]:
        """``(weighted sum, {function name: its value})`` of one episode; ``messages[n_prompt:]`` is the
        completion. A sync function runs on a thread."""
        given = {"prompt": prompt, "completion": messages[n_prompt:], "messages": messages,
                 "answer": prompt.answer, "state": state}
        total, parts = 0.0, {}
        for fn, weight in self.funcs:
            kwargs = {k: given[k] for k in inspect.signature(fn).parameters}
            value = fn(**kwargs) if inspect.iscoroutinefunction(fn) else await asyncio.to_thread(fn, **kwargs)
            value = float(await value) if inspect.isawaitable(value) else float(value)
            parts[getattr(fn, "__name__", repr(fn))] = value
            total += weight * value
        return total, parts


async def task_reward(prompt: Prompt, completion: list[dict[str, Any]]) -> float:
    """The prompt's own reward (:func:`producers.rewards.score_many`: by its source's task type) of the last
    assistant message's content: the default :class:`Rubric`."""
    last = next((m.get("content") or "" for m in reversed(completion) if m["role"] == "assistant"), "")
    return (await rewards_of(prompt, [last]))[0]


class Environment:
    """An agent task's environment: tools, the tool-call format, the environment's answers and the rubric.

    Subclass to answer other than with tool results (a game, a simulated user: :meth:`env_response`) or to end
    episodes otherwise (:meth:`is_completed`); :meth:`start` and :meth:`close` bring up and tear down what the
    environment holds (MCP servers), once per worker.

    Args:
        tools: tools, as :class:`FunctionTool` or typed functions (:func:`function_tool`).
        rubric: the reward (default: :func:`task_reward` alone).
        parser: the registered tool-call parser (:data:`TOOL_PARSERS`).
        max_turns: the most model turns per episode (>= 1).
        system_prompt: a system message put before the prompt's messages, if any.
        mcp_servers: MCP servers (:class:`producers.mcp_tools.MCPServer`) whose tools are added at :meth:`start`.
        parallel_tool_calls: let a turn make several calls (OpenAI's ``parallel_tool_calls``): the turn is sampled
            without the parser's stop strings, so it ends where the model ends it, and its calls run concurrently.
            By default a turn ends as its first call closes, and no token is sampled past it.
        tool_timeout_s: the longest a tool call may take (seconds); a call that takes longer is answered
            ``error: ...`` (a sync tool's thread runs on, unwaited).

    Raises:
        ValueError: ``max_turns`` < 1, ``tool_timeout_s`` <= 0, or two tools share a name.
        KeyError: an unknown parser.
    """

    def __init__(self, tools: Sequence[FunctionTool | Callable[..., Any]] = (), rubric: Rubric | None = None,
                 parser: str = "hermes", max_turns: int = 4, system_prompt: str | None = None,
                 mcp_servers: Sequence[Any] = (), parallel_tool_calls: bool = False,
                 tool_timeout_s: float = 60.0) -> None:
        if max_turns < 1:
            raise ValueError(f"Environment max_turns must be >= 1, got {max_turns}")
        if tool_timeout_s <= 0:
            raise ValueError(f"Environment tool_timeout_s must be > 0, got {tool_timeout_s}")
        self.tool_timeout_s = tool_timeout_s
        self.tools: dict[str, FunctionTool] = {}
        self._add_tools(t if isinstance(t, FunctionTool) else function_tool(t) for t in tools)
        self.rubric = rubric if rubric is not None else Rubric([task_reward])
        self.parser = get_tool_parser(parser)
        self.max_turns = max_turns
        self.system_prompt = system_prompt
        self.mcp_servers = list(mcp_servers)
        self.parallel_tool_calls = parallel_tool_calls
        self._mcp_tools: set[str] = set()
        self._started: asyncio.AbstractEventLoop | None = None
        self._starting: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    def _add_tools(self, tools: Any) -> None:
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool

    async def start(self) -> None:
        """:meth:`open` the environment, once per event loop (a new loop opens it anew); concurrent callers wait
        for the first.

        Raises:
            As :meth:`open`.
        """
        loop = asyncio.get_running_loop()
        if self._starting is None or self._starting[0] is not loop:
            self._starting = (loop, asyncio.Lock())
        async with self._starting[1]:  # the rollouts of a worker's first prompts all ask at once
            if self._started is loop:
                return
            await self.close()
            await self.open()
            self._started = loop

    async def open(self) -> None:
        """Bring up what the environment holds: start the MCP servers and add their tools (:meth:`start` calls
        it once per event loop, after :meth:`close`).

        Raises:
            ValueError: an MCP tool's name clashes with another tool's.
            As :meth:`producers.mcp_tools.MCPServer.start`.
        """
        for server in self.mcp_servers:
            tools = await server.start()
            self._add_tools(tools)
            self._mcp_tools.update(t.name for t in tools)

    async def close(self) -> None:
        """Stop the MCP servers and drop their tools (:meth:`start` lists them again)."""
        for server in self.mcp_servers:
            await server.close()
        for name in self._mcp_tools:
            self.tools.pop(name, None)
        self._mcp_tools.clear()
        self._started = None

    def turn_stop(self) -> tuple[str, ...]:
        """The stop strings of a model turn: the parser's, or none when ``parallel_tool_calls`` is set."""
        return () if self.parallel_tool_calls else self.parser.stop

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools' OpenAI function-call schemas, in declaration order."""
        return [t.schema() for t in self.tools.values()]

    #: Whether the environment answers every model turn before the episode may end (a game whose step scores the
    #: move: the last move is stepped too). By default a turn is answered only when the episode goes on.
    answers_every_turn: ClassVar[bool] = False

    async def begin_episode(self, prompt: Prompt, state: dict[str, Any]) -> list[dict[str, Any]]:
        """The chat an episode starts from (by default :meth:`initial_messages`); may keep what the episode
        holds in ``state`` (:meth:`end_episode` lets it go)."""
        return self.initial_messages(prompt)

    async def end_episode(self, state: dict[str, Any]) -> None:
        """Let go of what :meth:`begin_episode` took for the episode (also when it failed or was cancelled); by
        default nothing."""

    def initial_messages(self, prompt: Prompt) -> list[dict[str, Any]]:
        """The chat an episode starts from: the system prompt (if any), then the prompt's messages (or its
        ``text`` as one user message)."""
        messages = list(prompt.messages) if prompt.messages else [{"role": "user", "content": prompt.text}]
        if self.system_prompt is not None:
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        return messages

    async def call_tool(self, call: ToolCall) -> str:
        """The answer to ``call``: its tool's text, or ``error: ...`` for an unknown tool, arguments that do not
        validate, a tool that raised (``SystemExit`` too, for a typed function) or did not answer in
        ``tool_timeout_s`` (the model sees the error, as a real tool's failure). Each error is counted
        (:func:`environment_errors`); a tool's first one in this process is logged."""
        tool = self.tools.get(call.name)
        if tool is None:
            return self._tool_error(call.name, call.arguments,
                                    f"no tool named {call.name!r}; the tools are {sorted(self.tools)}")
        try:
            return await asyncio.wait_for(tool.call(call.arguments), self.tool_timeout_s)
        except ValidationError as e:
            return self._tool_error(call.name, call.arguments,
                                    f"bad arguments for {call.name}: {e.errors(include_url=False)}")
        except asyncio.TimeoutError:
            return self._tool_error(call.name, call.arguments,
                                    f"{call.name} did not answer in {self.tool_timeout_s:g} s")
        except Exception as e:  # noqa: BLE001  a failed tool is an observation
            return self._tool_error(call.name, call.arguments, f"{call.name} failed: {type(e).__name__}: {e}")

    def _tool_error(self, name: str, arguments: dict[str, Any], why: str) -> str:
        """Count (and, for a tool's first, log) a failed call of tool ``name``; the text the model is shown."""
        _count("tool_call_errors")
        if name not in _logged_tools:
            _logged_tools.add(name)
            log.warning("tool call %s(%s) answered an error (further ones are counted in tool_call_errors_total): %s",
                        name, json.dumps(arguments)[:200], why)
        return f"error: {why}"

    async def env_response(self, messages: list[dict[str, Any]], turn: ParsedTurn,
                           state: dict[str, Any]) -> list[dict[str, Any]]:
        """The environment's answer to the model turn ``turn`` (the last of ``messages``): by default one
        ``tool`` message per call (the calls run concurrently), then one per malformed call."""
        answers = await asyncio.gather(*(self.call_tool(c) for c in turn.calls))
        state["tool_calls"] = state.get("tool_calls", 0) + len(turn.calls)
        out = [{"role": "tool", "tool_call_id": c.id, "name": c.name, "content": a}
               for c, a in zip(turn.calls, answers)]
        return out + [{"role": "tool", "content": e} for e in turn.errors]

    def is_completed(self, messages: list[dict[str, Any]], turn: ParsedTurn, state: dict[str, Any]) -> bool:
        """Whether the episode ends after the model turn ``turn``: by default when it made no call (an answer)
        or the environment set ``state["done"]``."""
        return bool(state.get("done")) or not (turn.calls or turn.errors)


#: Marks where an assistant turn's content ends in a rendered chat (:func:`render_delta`).
_END_OF_CONTENT = "\x1fASTRAFLOW-END-OF-CONTENT\x1f"


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """``messages`` through the tokenizer's chat template with ``tools`` and the generation prompt, as text."""
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)


def render_delta(tokenizer: Any, new: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """What the chat template renders after an assistant turn's content when ``new`` messages follow it: the
    turn's end, the new turns, and the next generation prompt (e.g. ``<|im_end|>\\n<|im_start|>user\\n
    <tool_response>...``). Rendered after a stand-in conversation, so the earlier turns are not rendered again.

    Raises:
        ValueError: the template does not render an assistant message's content verbatim (the delta cannot be
            found).
    """
    base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _END_OF_CONTENT}]
    text = render(tokenizer, base + new, tools)
    at = text.rfind(_END_OF_CONTENT)
    if at < 0:
        raise ValueError("the chat template does not render an assistant message's content verbatim")
    return text[at + len(_END_OF_CONTENT):]


def load_object(spec: str) -> Any:
    """The object ``spec`` names: ``package.module:name`` (imported from ``sys.path`` or, last, the working
    directory: :func:`policies.registry.import_user_module`) or ``path/to/file.py:name`` (loaded; a relative path
    is from the working directory).

    Raises:
        ValueError: ``spec`` has no ``:name``, the module or file cannot be imported (it is missing, or raised
            as it was imported), or lacks ``name``.
    """
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"{spec!r} is not module:name or file.py:name")
    try:
        if target.endswith(".py"):
            path = Path(target).resolve()
            name = f"astraflow_env_{path.stem}"
            module_spec = importlib.util.spec_from_file_location(name, path)
            if module_spec is None or module_spec.loader is None:
                raise ImportError(f"no such file {path}")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            module_spec.loader.exec_module(module)
        else:
            module = import_user_module(target)
    except Exception as e:  # noqa: BLE001  a module that raises as it is imported, whatever it raises
        raise ValueError(f"cannot import {target!r}: {type(e).__name__}: {e}") from None
    if not hasattr(module, attr):
        raise ValueError(f"{target!r} has no {attr!r}")
    return getattr(module, attr)


@register_workflow("environment")
class EnvironmentWorkflow(Workflow):
    """Runs an :class:`Environment` (module docstring): each sample is a multi-turn chat of the policy with
    the environment, rendered with the policy's chat template; the reward is the environment's rubric.

    Args:
        policies: role overrides; role ``policy``.
        env: ``module:name`` or ``file.py:name`` of an :class:`Environment`, or of a function returning one
            (called with ``env_args``).
        env_args: keyword arguments of that function.
        max_turns: overrides the environment's ``max_turns``.
        parallel_tool_calls: overrides the environment's ``parallel_tool_calls``.

    Raises:
        ValueError: ``env`` cannot be loaded, or is neither an Environment nor a function returning one;
            ``env_args`` for an Environment object; ``max_turns`` < 1; ``parallel_tool_calls`` not a bool.
    """

    roles: ClassVar[dict[str, str]] = {"policy": "actor"}

    def __init__(self, policies: Mapping[str, str] | None = None, env: str | Environment | None = None,
                 env_args: Mapping[str, Any] | None = None, max_turns: int | None = None,
                 parallel_tool_calls: bool | None = None) -> None:
        super().__init__(policies)
        if env is None:
            raise ValueError("workflow environment: options.env is required (module:name or file.py:name)")
        try:
            obj = load_object(env) if isinstance(env, str) else env
        except ValueError as e:
            raise ValueError(f"workflow environment: options.env: {e}") from None
        if not isinstance(obj, Environment):
            if not callable(obj):
                raise ValueError(f"workflow environment: options.env {env!r} is neither an Environment nor a "
                                 "function returning one")
            try:
                obj = obj(**(env_args or {}))
            except Exception as e:  # noqa: BLE001  the user's function: whatever it raises, named
                raise ValueError(f"workflow environment: options.env {env!r} called with options.env_args "
                                 f"{dict(env_args or {})} raised {type(e).__name__}: {e}") from None
        elif env_args:
            raise ValueError(f"workflow environment: options.env_args given, but {env!r} is an Environment "
                             "object, not a function to call with them")
        if not isinstance(obj, Environment):
            raise ValueError(f"workflow environment: options.env {env!r} returned {type(obj).__name__}, not an "
                             "Environment")
        if max_turns is not None:
            if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
                raise ValueError(f"workflow environment: options.max_turns must be an integer >= 1, got "
                                 f"{max_turns!r}")
            obj.max_turns = max_turns
        if parallel_tool_calls is not None:
            if not isinstance(parallel_tool_calls, bool):
                raise ValueError("workflow environment: options.parallel_tool_calls must be true or false, got "
                                 f"{parallel_tool_calls!r}")
            obj.parallel_tool_calls = parallel_tool_calls
        self.env = obj
        #: the run's configured tools the environment calls (:func:`run_tool`): the RaaS worker refuses a config
        #: without them
        self.tools = tuple(t.run_tool for t in obj.tools.values() if t.run_tool)

    async def close(self) -> None:
        """Close the environment (its MCP servers)."""
        await self.env.close()

    async def _episode(self, eng: EngineBatcher, prompt: Prompt, sampling: SamplingParams,
                       ) -> tuple[Trajectory, list[dict[str, Any]], int, dict[str, Any]]:
        """One sample: its trajectory, its messages, how many of them are the prompt's, and its state."""
        env = self.env
        state: dict[str, Any] = {"turns": 0}
        try:
            messages = await env.begin_episode(prompt, state)
            return await self._turns(eng, messages, sampling, state)
        finally:
            await env.end_episode(state)

    async def _turns(self, eng: EngineBatcher, messages: list[dict[str, Any]], sampling: SamplingParams,
                     state: dict[str, Any]) -> tuple[Trajectory, list[dict[str, Any]], int, dict[str, Any]]:
        """The model's turns and the environment's answers from ``messages`` until the episode ends."""
        env, tok = self.env, eng.tokenizer
        schemas = env.tool_schemas()
        n_prompt = len(messages)
        text = render(tok, messages, schemas)
        if schemas and text == render(tok, messages, None):
            raise ValueError(f"the chat template of policy {self.policies['policy']!r} renders no tools: the "
                             f"model would not see the tools {sorted(env.tools)}")
        traj = Trajectory(tok.encode(text, add_special_tokens=False))
        turn_sampling = dataclasses.replace(sampling, stop=tuple(dict.fromkeys(sampling.stop + env.turn_stop())))
        eos = tok.eos_token_id
        while True:
            gen = await eng.generate(traj.ids, turn_sampling)
            traj.add_generation(gen)
            turn = env.parser.read(tok.decode(gen.output_ids.tolist(), skip_special_tokens=True),
                                    first_id=sum(len(m.get("tool_calls", ())) for m in messages))
            messages.append(turn.message())
            state["turns"] = traj.turns
            new = await env.env_response(messages, turn, state) if env.answers_every_turn else None
            if new is not None:
                messages.extend(new)
            if gen.finish_reason == "length" or traj.turns >= env.max_turns or env.is_completed(messages, turn,
                                                                                                 state):
                return traj, messages, n_prompt, state
            if new is None:
                new = await env.env_response(messages, turn, state)
                messages.extend(new)
            delta = render_delta(tok, new, schemas)
            if eos is not None and gen.output_ids.size and int(gen.output_ids[-1]) == eos \
                    and tok.eos_token and delta.startswith(tok.eos_token):
                delta = delta[len(tok.eos_token):]  # the turn's end token was sampled already
            traj.add_context(tok.encode(delta, add_special_tokens=False))

    async def rollout(self, prompt: Prompt, engines: Mapping[str, EngineBatcher], sampling: SamplingParams,
                      tools: Mapping[str, Tool]) -> list[TrajectoryGroup]:
        eng = self.engine(engines, "policy")
        current_run_tools.set(tools)
        await self.env.start()
        episodes = await gather_episodes([self._episode(eng, prompt, sampling) for _ in range(prompt.n_samples)])
        rewards = [(await self.env.rubric.score(prompt, messages, n, state))[0]
                   for _, messages, n, state in episodes]
        return [self.group(prompt, "policy", [t.to_sample(r) for (t, *_), r in zip(episodes, rewards)])]

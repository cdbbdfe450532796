"""The ``openenv`` workflow: RaaS episodes against an OpenEnv environment server (PyPI ``openenv-core``).

An OpenEnv server gives each WebSocket connection on ``/ws`` an environment instance of its own (a *session*);
the client sends JSON messages ``{"type": "reset", "data": {seed, ...}}``, ``{"type": "step", "data": action}``
and ``{"type": "close"}``, and the server answers each reset and step with ``{"type": "observation", "data":
{"observation": {...}, "reward": r, "done": d}}`` or ``{"type": "error", "data": {"message", "code"}}``;
``GET /schema`` gives the action's JSON schema and ``GET /health`` its liveness. This module speaks that protocol
with aiohttp, so the workers need none of openenv-core's server stack.

Each episode takes a session from :class:`OpenEnvClient`'s pool (a new connection when none is idle: a worker
holds as many sessions as it runs episodes at once, up to ``raas.max_episodes + n_samples - 1``: it admits a whole
prompt while under ``raas.max_episodes``), resets it with a seed drawn
from the prompt's id (the G samples of a group play the same game), and shows the observation to the policy as a
user turn rendered with its chat template. Each model turn is the action's text field, stepped; the observation
is the next user turn (``loss_mask`` 0), and the step's reward adds to the episode's return, which is the
reward by default. The episode ends when the server says ``done`` or after ``max_turns`` moves.

**MCP-tool environments.** An OpenEnv ``MCPEnvironment`` served with OpenEnv's MCP actions (``GET /schema`` gives
``CallToolAction``, ``{"type": "call_tool", "tool_name", "arguments"}``, as its action) is detected from the schema
(or named: ``actions: mcp``). At open, a ``{"type": "list_tools"}`` step on a session lists its tools (``name``,
``description``, ``input_schema``): they become :class:`~producers.environments.FunctionTool` whose OpenAI schemas
the policy's chat template renders. Each model turn is read by the tool-call parser (``parser``, hermes by
default, with its stop strings); each call is stepped as a call-tool action on the episode's session, and its
result (the MCP result's text, or ``error: ...`` for the server's tool error) goes back as a ``tool`` message
(``loss_mask`` 0); the step's reward and ``done`` count as above. An unknown tool name is answered ``error: ...``
without stepping the server, and a malformed call with the parser's error (a parse error, counted as the
``environment`` workflow counts them); the episode goes on after either. A turn with no call ends the episode (the
model has answered: the return so far is its reward), as in the ``environment`` workflow.
"""
from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
from typing import Any, Awaitable, Callable, ClassVar, Mapping

import aiohttp

from producers.environments import (Environment, EnvironmentWorkflow, FunctionTool, ParsedTurn, Rubric, ToolCall,
                                    get_tool_parser)
from producers.workflows import ServiceUnavailable, register_workflow
from topics.schemas import Prompt


class OpenEnvError(RuntimeError):
    """The OpenEnv server refused a request, answered out of protocol, or did not answer in time."""


class OpenEnvUnavailable(OpenEnvError, ServiceUnavailable):
    """The OpenEnv server cannot be reached (no connection, or the connection dropped): the server's failure, not
    the prompt's (:class:`~producers.workflows.ServiceUnavailable`)."""


class OpenEnvSession:
    """One WebSocket session of an OpenEnv server: an environment instance of its own.

    Args:
        ws: the open connection to ``<url>/ws``.
        url: the server, for messages.
        timeout_s: the longest wait for one answer (seconds).
    """

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, url: str, timeout_s: float) -> None:
        self.ws, self.url, self.timeout_s = ws, url, timeout_s
        #: a request went out and its answer did not come back (cancelled, timed out): the session cannot be reused
        self.broken = False
        self._lock = asyncio.Lock()  # one request at a time: an answer is the next message on the connection

    async def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send ``message`` and return the answer's ``data`` (concurrent requests take turns).

        Raises:
            OpenEnvError: an ``error`` answer (its message and code), a closed connection, an answer that is not
                a JSON object, or none within ``timeout_s``; a session broken by an earlier request.
        """
        async with self._lock:
            return await self._request(message)

    async def _request(self, message: dict[str, Any]) -> dict[str, Any]:
        if self.broken:
            raise OpenEnvError(f"OpenEnv server {self.url}: the session lost an earlier answer; it cannot send "
                               f"{message['type']!r}")
        self.broken = True
        try:
            await self.ws.send_str(json.dumps(message))
            msg = await asyncio.wait_for(self.ws.receive(), self.timeout_s)
        except asyncio.TimeoutError:
            raise OpenEnvError(f"OpenEnv server {self.url}: no answer to {message['type']!r} in "
                               f"{self.timeout_s:g} s (options.timeout_s)") from None
        except (aiohttp.ClientError, ConnectionError) as e:
            raise OpenEnvUnavailable(f"OpenEnv server {self.url}: {message['type']!r} failed: {e}") from None
        if msg.type != aiohttp.WSMsgType.TEXT:
            raise OpenEnvUnavailable(f"OpenEnv server {self.url}: the session ended ({msg.type.name}) before it "
                                     f"answered {message['type']!r}")
        try:
            answer = json.loads(msg.data)
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or not isinstance(answer.get("data"), dict):
            raise OpenEnvError(f"OpenEnv server {self.url}: answered {message['type']!r} with {msg.data[:200]!r}")
        self.broken = False
        if answer.get("type") == "error":
            data = answer["data"]
            raise OpenEnvError(f"OpenEnv server {self.url} refused {message['type']!r}: "
                               f"{data.get('message')} (code {data.get('code')}"
                               + (f"; {data['active_sessions']} of {data['max_sessions']} sessions in use: the "
                                  "server must allow at least raas.max_episodes + n_samples - 1 sessions, the most "
                                  "episodes a worker runs at once"
                                  if "max_sessions" in data else "") + ")")
        return answer["data"]

    async def close(self) -> None:
        """End the session: when it is in step, a ``close`` message, then wait (at most 5 s) for the server to
        close the connection, which it does once it has let go of the session (so a new session finds it freed);
        then the connection."""
        if not self.broken and not self.ws.closed:
            try:
                await self.ws.send_str(json.dumps({"type": "close"}))
                await asyncio.wait_for(self.ws.receive(), 5.0)  # its close frame (aiohttp answers it)
            except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError):
                pass
        await self.ws.close()


class OpenEnvClient:
    """A pool of :class:`OpenEnvSession` on one OpenEnv server, on the event loop that :meth:`start` ran on.

    Args:
        url: the server's ``http://host:port``.
        timeout_s: the longest wait for a connection or one answer (seconds).
    """

    def __init__(self, url: str, timeout_s: float = 60.0) -> None:
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self._http: aiohttp.ClientSession | None = None
        self._idle: list[OpenEnvSession] = []
        #: the sessions open now (idle or in an episode)
        self.sessions = 0

    async def start(self) -> dict[str, Any]:
        """Open the HTTP client and return the server's ``GET /schema`` (``action``, ``observation``, ``state``
        JSON schemas).

        Raises:
            OpenEnvError: the server does not answer, or not with a schema, within ``timeout_s``.
        """
        # no connection limit (aiohttp's default is 100): each session holds a connection for as long as it is
        # open, and a worker holds one per episode in flight
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                           connector=aiohttp.TCPConnector(limit=0))
        try:
            async with self._http.get(f"{self.url}/schema") as resp:
                resp.raise_for_status()
                schema = await resp.json()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise OpenEnvUnavailable(f"OpenEnv server {self.url}: GET /schema failed: {type(e).__name__}: "
                                     f"{e}") from None
        if not isinstance(schema, dict) or not isinstance(schema.get("action"), dict):
            raise OpenEnvError(f"OpenEnv server {self.url}: GET /schema gave no action schema")
        return schema

    async def acquire(self) -> OpenEnvSession:
        """An idle session, or a new one.

        Raises:
            OpenEnvError: the WebSocket connection fails.
        """
        if self._idle:
            return self._idle.pop()
        if self._http is None:
            raise OpenEnvError("OpenEnvClient.start() was not called")
        ws_url = "ws" + self.url[len("http"):] if self.url.startswith("http") else self.url
        try:
            ws = await self._http.ws_connect(f"{ws_url}/ws", timeout=aiohttp.ClientWSTimeout(ws_close=5.0),
                                             max_msg_size=0)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise OpenEnvUnavailable(f"OpenEnv server {self.url}: cannot open a session on /ws: {type(e).__name__}: "
                                     f"{e}") from None
        self.sessions += 1
        return OpenEnvSession(ws, self.url, self.timeout_s)

    async def reset(self, data: dict[str, Any]) -> tuple[OpenEnvSession, dict[str, Any]]:
        """A session reset with ``data`` (``{"seed": ...}``) and the reset's answer: an idle session, or a new one.
        An idle session that the server closed while it waited in the pool (uvicorn, which serves OpenEnv, pings
        every WebSocket and closes one that does not answer in time; nobody reads a pooled session, so nobody
        answers) fails its reset without an answer: it is ended and the next one is tried.

        Raises:
            OpenEnvError: the reset of a new session fails, or the server refuses a reset.
        """
        while True:
            fresh = not self._idle
            session = await self.acquire()
            try:
                return session, await session.request({"type": "reset", "data": data})
            except OpenEnvError:
                await self.release(session)  # ended when broken (no answer came)
                if fresh or not session.broken:
                    raise

    async def release(self, session: OpenEnvSession) -> None:
        """Give ``session`` back for another episode, or end it if it is broken."""
        if session.broken or session.ws.closed or self._http is None:
            self.sessions -= 1
            await session.close()
        else:
            self._idle.append(session)

    async def close(self) -> None:
        """End the idle sessions and the HTTP client."""
        idle, self._idle = self._idle, []
        for session in idle:
            self.sessions -= 1
            await session.close()
        if self._http is not None:
            await self._http.close()
            self._http = None


def seed_of(prompt: Prompt) -> int:
    """The reset seed of ``prompt``'s episodes: the first 4 bytes of ``sha256(prompt_id)``, an int in
    ``[0, 2**32)``."""
    return int.from_bytes(hashlib.sha256(prompt.prompt_id.encode()).digest()[:4], "big")


def episode_return(state: dict[str, Any]) -> float:
    """The sum of the episode's step rewards (``state["return"]``): the default reward of an OpenEnv episode."""
    return float(state.get("return", 0.0))


#: How a server's actions are made: ``typed`` (its own action, the model's text in a string field) or ``mcp``
#: (OpenEnv's MCP actions: ``list_tools`` and ``call_tool``).
ACTIONS = ("typed", "mcp")


def takes_mcp_actions(action: Mapping[str, Any]) -> bool:
    """Whether ``action`` (the action JSON schema of ``GET /schema``) is OpenEnv's MCP action: ``CallToolAction``
    or a subclass of it (a ``type`` field whose ``const`` or default is ``"call_tool"``), or the bare ``Action``
    (no field but ``metadata``), for which an OpenEnv server reads MCP actions too."""
    fields = action.get("properties", {})
    kind = fields.get("type")
    if isinstance(kind, dict) and "call_tool" in (kind.get("const"), kind.get("default")):
        return True
    return set(fields) <= {"metadata"}


def call_tool_text(observation: Mapping[str, Any]) -> str:
    """What the model is shown of a call-tool step's observation (``CallToolObservation``: ``result``,
    ``error``): ``error: <message>`` for the server's error (unknown tool, bad arguments, a tool that raised, a
    timeout); for an MCP result (``content`` blocks) its text blocks joined by newlines (its structured content as
    JSON when it has no text), ``error: ...`` when it is an error result; any other result as text (JSON unless a
    string)."""
    error = observation.get("error")
    if error:
        return f"error: {error.get('message') if isinstance(error, dict) else error}"
    result = observation.get("result")
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        texts = [b["text"] for b in result["content"] if isinstance(b, dict) and b.get("type") == "text"]
        text = "\n".join(texts)
        if not texts and result.get("structured_content") is not None:
            text = json.dumps(result["structured_content"])
        return f"error: {text}" if result.get("is_error") else text
    return result if isinstance(result, str) else json.dumps(result)


#: The state of the episode the running task plays (:meth:`OpenEnvEnvironment.begin_episode` sets it): its session
#: is where an MCP tool's call is stepped.
current_episode: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("current_openenv_episode")


class OpenEnvEnvironment(Environment):
    """An :class:`~producers.environments.Environment` whose answers are an OpenEnv server's steps (module
    docstring).

    Args:
        url: the server's ``http://host:port`` (None: refused at :meth:`open`, naming who sets it).
        action_field: typed actions: the action's string field the model's text goes in (None: the action schema's
            only required string field).
        observation_field: the observation's field shown to the model (None: its only string field, else the
            whole observation as JSON); with MCP actions, of the reset's observation.
        max_turns: the most model turns per episode (>= 1).
        system_prompt: a system message before the first observation, if any.
        timeout_s: the longest wait for the server (seconds).
        actions: ``typed`` or ``mcp`` (:data:`ACTIONS`; None: detected from the server's action schema).
        parser: MCP actions: the tool-call parser (None: ``hermes``).

    Raises:
        ValueError: ``max_turns`` < 1; ``actions`` not in :data:`ACTIONS`.
        KeyError: an unknown ``parser``.
    """

    answers_every_turn: ClassVar[bool] = True

    def __init__(self, url: str | None, action_field: str | None = None, observation_field: str | None = None,
                 max_turns: int = 8, system_prompt: str | None = None, timeout_s: float = 60.0,
                 actions: str | None = None, parser: str | None = None) -> None:
        if actions is not None and actions not in ACTIONS:
            raise ValueError(f"OpenEnvEnvironment actions must be one of {list(ACTIONS)}, got {actions!r}")
        super().__init__(rubric=Rubric([episode_return]), parser=parser or "hermes", max_turns=max_turns,
                         system_prompt=system_prompt)
        self.url = url
        self.client = OpenEnvClient(url or "", timeout_s)
        self.action_field, self.observation_field = action_field, observation_field
        self.configured_actions, self.configured_parser = actions, parser
        #: the server's actions, settled at :meth:`open` (None before)
        self.actions: str | None = None

    async def open(self) -> None:
        """Connect to the server, settle its actions from its schema, and the action field (typed) or the tools
        (MCP: a ``list_tools`` step on a session) (:meth:`start` calls it once per event loop).

        Raises:
            OpenEnvError: the server does not answer, or lists no tools, or not as OpenEnv does.
            ValueError (naming the option): no ``url``; ``actions`` contradicts the server's action schema; typed:
                ``parser`` is set, or ``action_field`` is not a string field of the action, or None and the action
                has not exactly one required string field; MCP: ``action_field`` is set.
        """
        if self.url is None:
            raise ValueError("workflow openenv: options.url is not set: `astraflow run` sets it for the server it "
                             "starts from options.command; a worker run alone needs options.url")
        action = (await self.client.start())["action"]
        mcp = takes_mcp_actions(action)
        if self.configured_actions is not None and (self.configured_actions == "mcp") != mcp:
            found = ("OpenEnv's MCP call_tool action (use actions: mcp, or leave it unset)" if mcp else
                     f"{action.get('title')!r} (fields {sorted(action.get('properties', {}))}), not OpenEnv's MCP "
                     "call_tool action")
            raise ValueError(f"workflow openenv: options.actions is {self.configured_actions!r}, but the action of "
                             f"{self.client.url} is {found}")
        self.actions = "mcp" if mcp else "typed"
        if mcp:
            if self.action_field is not None:
                raise ValueError(f"workflow openenv: options.action_field is for typed actions; the actions of "
                                 f"{self.client.url} are MCP tool calls")
            self.tools = {t.name: t for t in await self._list_tools()}
            return
        if self.configured_parser is not None:
            raise ValueError(f"workflow openenv: options.parser is for MCP-tool environments; the action of "
                             f"{self.client.url} is typed (the model's text is the action, not parsed)")
        strings = [k for k, v in action.get("properties", {}).items() if v.get("type") == "string"]
        if self.action_field is None:
            required = [k for k in strings if k in action.get("required", ())]
            if len(required) != 1:
                raise ValueError(f"workflow openenv: options.action_field is needed: the action of {self.client.url} "
                                 f"has the required string fields {required}, not exactly one")
            self.action_field = required[0]
        elif self.action_field not in strings:
            raise ValueError(f"workflow openenv: options.action_field {self.action_field!r} is not a string field of "
                             f"the action of {self.client.url} (its string fields: {strings})")

    async def _list_tools(self) -> list[FunctionTool]:
        """The server's tools, listed by a ``list_tools`` step on a session of the pool.

        Raises:
            OpenEnvError: the request fails, or the answer lists no tools or a tool without a string ``name`` and
                an object ``input_schema``.
        """
        session = await self.client.acquire()
        try:
            listed = (await session.request({"type": "step", "data": {"type": "list_tools"}})).get("observation")
        finally:
            await self.client.release(session)
        tools = listed.get("tools") if isinstance(listed, dict) else None
        if not tools or not isinstance(tools, list):
            raise OpenEnvError(f"OpenEnv server {self.client.url}: list_tools listed no tools (OpenEnv reports a "
                               f"failed listing as none; see the server's log): {json.dumps(listed)[:200]}")
        out = []
        for tool in tools:
            if not (isinstance(tool, dict) and isinstance(tool.get("name"), str)
                    and isinstance(tool.get("input_schema"), dict)):
                raise OpenEnvError(f"OpenEnv server {self.client.url}: list_tools listed {json.dumps(tool)[:200]}, "
                                   "not a tool with a string name and an object input_schema")
            out.append(FunctionTool(name=tool["name"], description=tool.get("description") or "",
                                    parameters=tool["input_schema"], call=self._caller(tool["name"])))
        return out

    def _caller(self, name: str) -> Callable[[dict[str, Any]], Awaitable[str]]:
        async def call(arguments: dict[str, Any]) -> str:
            state = current_episode.get(None)
            if state is None:
                raise OpenEnvError(f"tool {name!r} of OpenEnv server {self.client.url} is called outside an episode "
                                   "(it steps the episode's session)")
            return await self.step_tool(state, name, arguments)
        return call

    async def step_tool(self, state: dict[str, Any], name: str, arguments: dict[str, Any]) -> str:
        """Step the episode's session (``state["session"]``) with the call-tool action of ``name`` and
        ``arguments``; count the step's reward and ``done``; return what the model is shown (:func:`call_tool_text`;
        an observation that is not a call-tool one, as :meth:`observation_text`). The server's error for the call
        (unknown tool, bad arguments, a tool that raised) is counted as a failed tool call.

        Raises:
            OpenEnvError: the request fails (the episode cannot go on in its session).
        """
        result = await state["session"].request(
            {"type": "step", "data": {"type": "call_tool", "tool_name": name, "arguments": arguments}})
        self._record(result, state)
        obs = result.get("observation") or {}
        if "tool_name" not in obs:
            return self.observation_text(result)
        text = call_tool_text(obs)
        failed = obs.get("error") or (isinstance(obs.get("result"), dict) and obs["result"].get("is_error"))
        return self._tool_error(name, arguments, text.removeprefix("error: ")) if failed else text

    async def close(self) -> None:
        """End the sessions and the HTTP client; forget the listed tools (:meth:`open` lists them again)."""
        await self.client.close()
        self.tools.clear()
        await super().close()

    def observation_text(self, result: Mapping[str, Any]) -> str:
        """What the model is shown of a reset's or step's ``observation``.

        Raises:
            OpenEnvError: ``observation_field`` is set and the observation lacks it.
        """
        obs = result.get("observation") or {}
        if self.observation_field is not None:
            if self.observation_field not in obs:
                raise OpenEnvError(f"OpenEnv server {self.client.url}: the observation has no field "
                                   f"{self.observation_field!r} (options.observation_field; fields: {sorted(obs)})")
            value = obs[self.observation_field]
            return value if isinstance(value, str) else json.dumps(value)
        strings = [v for v in obs.values() if isinstance(v, str)]
        return strings[0] if len(strings) == 1 else json.dumps(obs)

    def _record(self, result: Mapping[str, Any], state: dict[str, Any]) -> None:
        state["return"] = state.get("return", 0.0) + float(result.get("reward") or 0.0)
        state["done"] = bool(result.get("done"))

    async def begin_episode(self, prompt: Prompt, state: dict[str, Any]) -> list[dict[str, Any]]:
        """Take a session reset with :func:`seed_of` the prompt (:meth:`OpenEnvClient.reset`), and return the chat
        of the first observation (after the system prompt, if any). The episode's tool calls step this session
        (:data:`current_episode`)."""
        state["session"], result = await self.client.reset({"seed": seed_of(prompt)})
        current_episode.set(state)
        self._record(result, state)
        messages = [{"role": "user", "content": self.observation_text(result)}]
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    async def end_episode(self, state: dict[str, Any]) -> None:
        """Give the episode's session back to the pool (ended instead when a request of it was cut short)."""
        session = state.pop("session", None)
        if session is not None:
            await self.client.release(session)

    async def call_tool(self, call: ToolCall) -> str:
        """MCP actions: the answer to ``call`` in the running episode (:meth:`step_tool`), or ``error: ...`` for
        an unknown tool (the server is not asked).

        Raises:
            OpenEnvError: the episode's session fails (unlike a tool's failure, which the model is shown).
        """
        tool = self.tools.get(call.name)
        return await super().call_tool(call) if tool is None else await tool.call(call.arguments)

    async def env_response(self, messages: list[dict[str, Any]], turn: ParsedTurn,
                           state: dict[str, Any]) -> list[dict[str, Any]]:
        """Typed actions: step the session with the turn's text as the action; the observation as a user message.
        MCP actions: the turn's calls stepped (:meth:`call_tool`), as ``tool`` messages, then one per malformed
        call."""
        if self.actions == "mcp":
            return await super().env_response(messages, turn, state)
        result = await state["session"].request({"type": "step", "data": {self.action_field: turn.content}})
        self._record(result, state)
        return [{"role": "user", "content": self.observation_text(result)}]

    def is_completed(self, messages: list[dict[str, Any]], turn: ParsedTurn, state: dict[str, Any]) -> bool:
        """Whether the server said ``done``; with MCP actions, also when the turn made no call (an answer)."""
        if self.actions == "mcp":
            return super().is_completed(messages, turn, state)
        return bool(state.get("done"))


@register_workflow("openenv")
class OpenEnvWorkflow(EnvironmentWorkflow):
    """Runs an OpenEnv environment server's episodes (:class:`OpenEnvEnvironment`, module docstring).

    Args:
        policies: role overrides; role ``policy``.
        url: the server's ``http://host:port``.
        command: the server's command line, with ``{port}`` where its port goes: ``astraflow run`` starts it and
            gives the workers its ``url`` (a worker given a command and no url refuses its first episode).
        action_field, observation_field, max_turns, system_prompt, timeout_s, actions, parser: as
            :class:`OpenEnvEnvironment`.

    Raises:
        ValueError: neither ``url`` nor ``command``, a ``url`` that is not http(s), ``max_turns`` < 1,
            ``timeout_s`` <= 0, ``actions`` not ``typed`` or ``mcp``, or an unknown ``parser`` (each naming its
            option).
    """

    def __init__(self, policies: Mapping[str, str] | None = None, url: str | None = None, command: str | None = None,
                 action_field: str | None = None, observation_field: str | None = None, max_turns: int = 8,
                 system_prompt: str | None = None, timeout_s: float = 60.0, actions: str | None = None,
                 parser: str | None = None) -> None:
        if url is None and command is None:
            raise ValueError("workflow openenv: options.url (the server's http://host:port) or options.command (the "
                             "server's command line, which `astraflow run` starts) is required")
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"workflow openenv: options.url {url!r} is not an http:// or https:// URL")
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise ValueError(f"workflow openenv: options.max_turns must be an integer >= 1, got {max_turns!r}")
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or timeout_s <= 0:
            raise ValueError(f"workflow openenv: options.timeout_s must be a number > 0, got {timeout_s!r}")
        if actions is not None and actions not in ACTIONS:
            raise ValueError(f"workflow openenv: options.actions must be one of {list(ACTIONS)} (or unset: detected "
                             f"from the server), got {actions!r}")
        if parser is not None:
            try:
                get_tool_parser(parser)
            except KeyError as e:
                raise ValueError(f"workflow openenv: options.parser: {e.args[0]}") from None
        super().__init__(policies, env=OpenEnvEnvironment(url, action_field, observation_field, max_turns,
                                                          system_prompt, timeout_s, actions, parser))

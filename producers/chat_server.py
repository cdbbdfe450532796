"""An OpenAI-compatible ``/v1/chat/completions`` endpoint on loopback, backed by a rollout engine: for environments
that drive the model through an OpenAI client themselves (a verifiers environment's agent, any agent framework).

:class:`ChatServer` serves one policy's :class:`~producers.engine_batcher.EngineBatcher` from the event loop the
episodes run in. A request's ``messages`` (and ``tools``) go through the policy's chat template; with tools, the
turn is sampled with the tool parser's stop strings (none when the request sets ``parallel_tool_calls``) and the
reply's ``tool_calls`` are parsed from it (the ``hermes`` parser by default,
:data:`producers.environments.TOOL_PARSERS`). The answer is OpenAI's shape, plus what
training needs: ``prompt_token_ids`` and each choice's ``token_ids`` (vLLM's names), per-token ``logprobs`` when
asked (``logprobs: true``) and the weight ``version`` that sampled it.

Every call is recorded in a :class:`Session` (keyed by the ``X-Session-ID`` header, else the body's ``user``) as a
:class:`~producers.workflows.Trajectory`: a request that continues the session's chat (its messages are the
previous request's, the reply, then new ones) appends only the chat template's delta for the new messages
(:func:`producers.environments.render_delta`), so earlier tokens, generated ones included, are never
re-tokenized; any other request starts a new trajectory of the session.

The ``openai_agent`` workflow (:class:`OpenAIAgentWorkflow`) runs an agent of your own that drives the model
through an OpenAI client (``async def agent(client, model, prompt, tools) -> answer``) in RaaS episodes: each
sample is a session of the worker's endpoint, and its trajectory is the sample.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any, ClassVar, Mapping

from aiohttp import web

from producers.engine_batcher import EngineBatcher, EngineCallFailed
from producers.engines import GenerationInterrupted, SamplingParams
from producers.environments import get_tool_parser, load_object, render, render_delta
from producers.ports import listen
from producers.workflows import Tool, Trajectory, Workflow, gather_episodes, register_workflow, rewards_of
from topics.schemas import Prompt, TrajectoryGroup

#: The header naming a request's session (verifiers sends the rollout's trace id in it).
SESSION_HEADER = "X-Session-ID"


@dataclasses.dataclass
class Session:
    """The calls of one session (an episode): its trajectories, and the chat its last one renders.

    Attributes:
        trajectories: token sequences, one per chat the session started (usually one).
        messages: the messages the last trajectory renders (the last request's and its reply).
        calls: requests served.
        failure: the engine's failure a request of the session met (an interrupted or failed engine call,
            answered with HTTP 503), for the workflow to raise as such.
    """

    trajectories: list[Trajectory] = dataclasses.field(default_factory=list)
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    calls: int = 0
    failure: BaseException | None = None


class BadRequest(ValueError):
    """A request the endpoint refuses (HTTP 400 with the reason)."""


def _normal(message: dict[str, Any]) -> dict[str, Any]:
    """A message in the form a chat template renders: an assistant's tool-call arguments decoded from their JSON
    string (OpenAI's wire form) to an object."""
    if message.get("role") != "assistant" or not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        fn = dict(call.get("function", {}))
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass
        calls.append({**call, "function": fn})
    return {**message, "tool_calls": calls}


def _key(message: dict[str, Any]) -> tuple:
    """What a message says (role, text, calls, the call it answers), so that a client's echo of a reply (with
    ``None`` fields, ``content`` null) matches the reply."""
    calls = tuple((c.get("function", {}).get("name"), json.dumps(c.get("function", {}).get("arguments"),
                                                                 sort_keys=True))
                  for c in message.get("tool_calls") or ())
    return message.get("role"), message.get("content") or "", calls, message.get("tool_call_id")


class ChatServer:
    """An OpenAI-compatible chat endpoint for one policy, in the running event loop.

    Args:
        engine: the policy's batcher.
        model: the model name it answers to (any name is accepted; this one is reported).
        parser: the tool-call parser of replies to requests with ``tools``.
        max_new_tokens: the token budget when a request sets none, and the most a request may ask for.
        sampling: the run's sampling, when set: its temperature and top-p replace a request's (the behaviour
            logprobs and the trainer's recompute must share them) and its ``max_new_tokens`` caps a request's.
        host, port: where to listen (port 0: a free one; :attr:`url` tells which once started).

    Raises:
        KeyError: an unknown parser.
    """

    def __init__(self, engine: EngineBatcher, model: str = "policy", parser: str = "hermes",
                 max_new_tokens: int = 256, sampling: SamplingParams | None = None, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.engine, self.model, self.parser = engine, model, get_tool_parser(parser)
        self.sampling = sampling
        self.max_new_tokens, self.host, self.port = max_new_tokens, host, port
        self.sessions: dict[str, Session] = {}
        self.url: str | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        """Listen; returns the base URL of the API (``http://host:port/v1``).

        Raises:
            OSError: the port cannot be bound.
        """
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        self.port = await listen(self._runner, self.host, self.port)
        self.url = f"http://{self.host}:{self.port}/v1"
        return self.url

    async def stop(self) -> None:
        """Stop listening."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def pop_session(self, session_id: str) -> Session:
        """The calls recorded under ``session_id``, forgotten here (an empty session when there were none)."""
        return self.sessions.pop(session_id, Session())

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _completions(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("the body is not a JSON object")
            session_id = request.headers.get(SESSION_HEADER) or body.get("user") or uuid.uuid4().hex
            return web.json_response(await self.complete(body, session_id))
        except (GenerationInterrupted, EngineCallFailed) as e:  # the engine's, not the request's: kept for the rollout
            self.sessions.setdefault(session_id, Session()).failure = e
            return web.json_response({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}},
                                     status=503)
        except (BadRequest, ValueError) as e:
            return web.json_response({"error": {"message": str(e), "type": "invalid_request_error"}}, status=400)

    def _sampling(self, body: dict[str, Any], tools: bool) -> SamplingParams:
        """The request's sampling (``max_completion_tokens``/``max_tokens``, ``temperature``, ``top_p``, ``stop``,
        ``seed``), with the parser's stop strings when it offers tools, unless it sets ``parallel_tool_calls``:
        then the turn ends where the model ends it and may make several calls (OpenAI's default is true; ours is
        false, so that no token is sampled past a call).

        Raises:
            BadRequest: ``n`` other than 1, or a bad value (the message names the field).
        """
        if body.get("n", 1) != 1:
            raise BadRequest(f"n={body['n']!r}: one choice per request, n=1 (send G requests for G samples)")
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else stop
        if not isinstance(stop, list | tuple) or not all(isinstance(x, str) for x in stop):
            raise BadRequest(f"stop={body.get('stop')!r}: a string or a list of strings")
        stop = tuple(stop)
        parallel = body.get("parallel_tool_calls")
        parallel = False if parallel is None else parallel  # null: unset, as OpenAI's clients may send it
        if not isinstance(parallel, bool):
            raise BadRequest(f"parallel_tool_calls={parallel!r}: must be true or false")
        if tools and not parallel:
            stop = tuple(dict.fromkeys(stop + self.parser.stop))
        try:
            asked = [body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None]
            budget = int(asked[0]) if asked else self.max_new_tokens
            if budget < 1:
                raise ValueError(f"max_tokens={budget}: at least 1")
            temperature, top_p = float(body.get("temperature", 1.0)), float(body.get("top_p", 1.0))
            budget = min(budget, self.max_new_tokens)
            if self.sampling is not None:
                budget = min(budget, self.sampling.max_new_tokens)
                temperature, top_p = self.sampling.temperature, self.sampling.top_p
            return SamplingParams(max_new_tokens=budget, temperature=temperature, top_p=top_p, stop=stop,
                                  seed=body.get("seed"))
        except (TypeError, ValueError) as e:
            raise BadRequest(f"bad sampling field: {e}") from None

    def _trajectory(self, session: Session, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    ) -> Trajectory:
        """The trajectory this request extends (its messages continue the session's chat: only the delta of the
        new ones is appended), or a new one of the session."""
        tok = self.engine.tokenizer
        seen = session.messages
        if session.trajectories and len(messages) > len(seen) and \
                [_key(m) for m in messages[:len(seen)]] == [_key(m) for m in seen]:
            traj = session.trajectories[-1]
            delta = render_delta(tok, messages[len(seen):], tools)
            eos = tok.eos_token
            if eos and traj.ids and traj.ids[-1] == tok.eos_token_id and delta.startswith(eos):
                delta = delta[len(eos):]  # the turn's end token was sampled already
            traj.add_context(tok.encode(delta, add_special_tokens=False))
            return traj
        traj = Trajectory(tok.encode(render(tok, messages, tools), add_special_tokens=False))
        session.trajectories.append(traj)
        return traj

    async def complete(self, body: dict[str, Any], session_id: str) -> dict[str, Any]:
        """The chat completion of ``body`` (OpenAI's request shape) in session ``session_id``.

        Raises:
            BadRequest: no ``messages``, or a bad sampling field.
        """
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] is not an object with a string role: {json.dumps(m)[:200]}")
        messages = [_normal(m) for m in messages]
        tools = body.get("tools") or None
        sampling = self._sampling(body, bool(tools))
        session = self.sessions.setdefault(session_id, Session())
        traj = self._trajectory(session, messages, tools)
        prompt_ids = list(traj.ids)
        gen = await self.engine.generate(prompt_ids, sampling)
        traj.add_generation(gen)
        session.calls += 1
        tok = self.engine.tokenizer
        ids = gen.output_ids.tolist()
        text = tok.decode(ids, skip_special_tokens=True)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = "length" if gen.finish_reason == "length" else "stop"
        if tools:
            turn = self.parser.read(text, first_id=sum(len(m.get("tool_calls") or ()) for m in messages))
            message = {"role": "assistant", "content": turn.content}
            if turn.calls:
                message["tool_calls"] = [{"id": c.id, "type": "function",
                                          "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                         for c in turn.calls]
                finish = "tool_calls"
        session.messages = messages + [_normal(message)]
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "token_ids": ids,
                                  "version": gen.version}
        if body.get("logprobs"):
            choice["logprobs"] = {"content": [{"token": tok.decode([t]), "logprob": float(lp), "bytes": None,
                                               "top_logprobs": []} for t, lp in zip(ids, gen.logprobs.tolist())]}
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model") or self.model, "choices": [choice], "prompt_token_ids": prompt_ids,
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                          "total_tokens": len(prompt_ids) + len(ids)}}


class ChatEndpointWorkflow(Workflow):
    """A workflow whose episodes drive the policy through the worker's loopback :class:`ChatServer` (role
    ``policy``), started at its first rollout with the run's sampling (its temperature and top-p, its
    ``max_new_tokens`` per call) and stopped by :meth:`close`.

    Args:
        policies: role overrides; role ``policy``.
        parser: the tool-call parser of the endpoint's replies.

    Raises:
        KeyError: an unknown parser.
    """

    roles: ClassVar[dict[str, str]] = {"policy": "actor"}

    def __init__(self, policies: Mapping[str, str] | None = None, parser: str = "hermes") -> None:
        super().__init__(policies)
        get_tool_parser(parser)
        self.parser = parser
        self._server: tuple[asyncio.AbstractEventLoop, ChatServer] | None = None
        self._starting: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    async def _endpoint(self, eng: EngineBatcher, sampling: SamplingParams) -> ChatServer:
        """The worker's endpoint, started once per event loop."""
        loop = asyncio.get_running_loop()
        if self._starting is None or self._starting[0] is not loop:
            self._starting = (loop, asyncio.Lock())
        async with self._starting[1]:
            if self._server is None or self._server[0] is not loop:
                server = ChatServer(eng, model=self.policies["policy"], parser=self.parser,
                                    max_new_tokens=sampling.max_new_tokens, sampling=sampling)
                await server.start()
                self._server = (loop, server)
        return self._server[1]

    async def close(self) -> None:
        """Stop the endpoint."""
        if self._server is not None:
            await self._server[1].stop()
            self._server = None


@register_workflow("openai_agent")
class OpenAIAgentWorkflow(ChatEndpointWorkflow):
    """Runs an agent that drives the policy through an OpenAI client, each sample an episode of its own.

    The worker serves the policy on a loopback :class:`ChatServer` (:class:`ChatEndpointWorkflow`). Each sample
    calls ``await agent(client=..., model=..., prompt=..., tools=...)`` with an ``openai.AsyncOpenAI`` client
    whose requests carry the sample's session id; the agent returns its final answer (text). The sample is the
    session's last trajectory (``loss_mask`` 1 on the model's tokens); its reward is the prompt's own
    (:func:`producers.rewards.score_many`) of the answer.

    Args:
        policies: role overrides; role ``policy``.
        agent: ``module:name`` or ``file.py:name`` of the agent coroutine function.
        parser: the tool-call parser of the endpoint's replies.

    Raises:
        ValueError: ``agent`` cannot be loaded or is not a coroutine function.
        KeyError: an unknown parser.
    """

    def __init__(self, policies: Mapping[str, str] | None = None, agent: str | None = None,
                 parser: str = "hermes") -> None:
        super().__init__(policies, parser)
        if agent is None:
            raise ValueError("workflow openai_agent: options.agent is required (module:name or file.py:name)")
        self.agent = load_object(agent)
        if not asyncio.iscoroutinefunction(self.agent):
            raise ValueError(f"workflow openai_agent: options.agent {agent!r} is not an async function")

    async def _episode(self, server: ChatServer, prompt: Prompt, tools: Mapping[str, Tool]) -> tuple[Trajectory, str]:
        """One sample: its trajectory and the agent's answer.

        Raises:
            ValueError: the agent returned no text, or never called the model.
            GenerationInterrupted, EngineCallFailed: a model call of the agent met one (whatever the agent made
                of its HTTP 503).
        """
        import openai

        session = uuid.uuid4().hex
        client = openai.AsyncOpenAI(base_url=server.url, api_key="astraflow", max_retries=0,
                                    default_headers={SESSION_HEADER: session})
        try:
            answer = await self.agent(client=client, model=server.model, prompt=prompt, tools=tools)
        except Exception:
            failure = server.pop_session(session).failure
            if failure is not None:  # an interrupted or failed engine call stays what it is for the worker
                raise failure from None
            raise
        finally:
            await client.close()
        calls = server.pop_session(session)
        if calls.failure is not None:
            raise calls.failure
        if not isinstance(answer, str):
            raise ValueError(f"the agent returned {type(answer).__name__}, not the answer text")
        if not calls.trajectories:
            raise ValueError("the agent never called the model")
        return calls.trajectories[-1], answer

    async def rollout(self, prompt: Prompt, engines: Mapping[str, EngineBatcher], sampling: SamplingParams,
                      tools: Mapping[str, Tool]) -> list[TrajectoryGroup]:
        server = await self._endpoint(self.engine(engines, "policy"), sampling)
        episodes = await gather_episodes([self._episode(server, prompt, tools) for _ in range(prompt.n_samples)])
        rewards = await rewards_of(prompt, [answer for _, answer in episodes])
        return [self.group(prompt, "policy", [t.to_sample(r) for (t, _), r in zip(episodes, rewards)])]

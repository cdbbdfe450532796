"""An OpenAI-compatible ``/v1/chat/completions`` endpoint on loopback, backed by a rollout engine: for environments
that drive the model through an OpenAI client themselves (a verifiers environment's agent, any agent framework).

:class:`ChatServer` serves one policy's :class:`~producers.engine_batcher.EngineBatcher` from the event loop the
episodes run in. A request's ``messages`` (and ``tools``) go through the policy's chat template; with tools, the
turn is sampled with the tool parser's stop strings and the reply's ``tool_calls`` are parsed from it (the
``hermes`` parser by default, :data:`producers.environments.TOOL_PARSERS`). The answer is OpenAI's shape, plus what
training needs: ``prompt_token_ids`` and each choice's ``token_ids`` (vLLM's names), per-token ``logprobs`` when
asked (``logprobs: true``) and the weight ``version`` that sampled it.

Every call is recorded in a :class:`Session` (keyed by the ``X-Session-ID`` header, else the body's ``user``) as a
:class:`~producers.workflows.Trajectory`: a request that continues the session's chat (its messages are the
previous request's, the reply, then new ones) appends only the chat template's delta for the new messages
(:func:`producers.environments.render_delta`), so earlier tokens, generated ones included, are never
re-tokenized; any other request starts a new trajectory of the session.
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any

from aiohttp import web

from producers.engine_batcher import EngineBatcher
from producers.engines import SamplingParams
from producers.environments import get_tool_parser, render, render_delta
from producers.workflows import Trajectory

#: The header naming a request's session (verifiers sends the rollout's trace id in it).
SESSION_HEADER = "X-Session-ID"


@dataclasses.dataclass
class Session:
    """The calls of one session (an episode): its trajectories, and the chat its last one renders.

    Attributes:
        trajectories: token sequences, one per chat the session started (usually one).
        messages: the messages the last trajectory renders (the last request's and its reply).
        calls: requests served.
    """

    trajectories: list[Trajectory] = dataclasses.field(default_factory=list)
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    calls: int = 0


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
        max_new_tokens: the token budget when a request sets none.
        host, port: where to listen (port 0: a free one; :attr:`url` tells which once started).

    Raises:
        KeyError: an unknown parser.
    """

    def __init__(self, engine: EngineBatcher, model: str = "policy", parser: str = "hermes",
                 max_new_tokens: int = 256, host: str = "127.0.0.1", port: int = 0) -> None:
        self.engine, self.model, self.parser = engine, model, get_tool_parser(parser)
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
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, self.host, self.port).start()
        except OSError:
            await self._runner.cleanup()
            raise
        self.port = self._runner.addresses[0][1]
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
        except (BadRequest, ValueError) as e:
            return web.json_response({"error": {"message": str(e), "type": "invalid_request_error"}}, status=400)

    def _sampling(self, body: dict[str, Any], tools: bool) -> SamplingParams:
        """The request's sampling (``max_completion_tokens``/``max_tokens``, ``temperature``, ``top_p``, ``stop``,
        ``seed``), with the parser's stop strings when it offers tools.

        Raises:
            BadRequest: ``n`` other than 1, or a bad value (the message names the field).
        """
        if body.get("n", 1) != 1:
            raise BadRequest(f"n={body['n']}: one choice per request (send G requests for G samples)")
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if tools:
            stop = tuple(dict.fromkeys(stop + self.parser.stop))
        try:
            return SamplingParams(max_new_tokens=int(body.get("max_completion_tokens") or body.get("max_tokens")
                                                     or self.max_new_tokens),
                                  temperature=float(body.get("temperature", 1.0)),
                                  top_p=float(body.get("top_p", 1.0)), stop=stop, seed=body.get("seed"))
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
            turn = self.parser.parse(text, first_id=sum(len(m.get("tool_calls") or ()) for m in messages))
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

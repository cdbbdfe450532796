"""Tools of an MCP server (the Model Context Protocol, through the ``mcp`` SDK) as an environment's tools.

:class:`MCPServer` starts a server as a subprocess speaking MCP over stdio, lists its tools (name, description,
input JSON schema: each becomes a :class:`~producers.environments.FunctionTool`) and calls them. One session per
worker event loop serves every episode's calls concurrently. Part of the ``environments`` extra
(``pip install astraflow[environments]``).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Sequence

from producers.environments import FunctionTool


class MCPServer:
    """An MCP server run as a stdio subprocess: ``await start()`` -> its tools.

    Args:
        command: the program and its arguments (``["python", "my_server.py"]``).
        env: extra environment variables of the subprocess.
        cwd: its working directory.
        startup_timeout_s: the bound on starting it and listing its tools, seconds.
        call_timeout_s: the bound on one tool call, seconds (a call past it answers ``error: ... timed out``).

    Raises:
        ValueError: an empty ``command``, or a bound that is not positive.
    """

    def __init__(self, command: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None,
                 startup_timeout_s: float = 60.0, call_timeout_s: float = 60.0) -> None:
        if not command:
            raise ValueError("MCPServer: command is empty")
        if startup_timeout_s <= 0 or call_timeout_s <= 0:
            raise ValueError(f"MCPServer: timeouts must be positive, got {startup_timeout_s}, {call_timeout_s}")
        self.command, self.env, self.cwd = list(command), env, cwd
        self.startup_timeout_s, self.call_timeout_s = startup_timeout_s, call_timeout_s
        self._session: Any = None
        self._owner: asyncio.Task | None = None
        self._stop: asyncio.Event | None = None

    async def start(self) -> list[FunctionTool]:
        """Start the server (in the running event loop), open its session and list its tools.

        Raises:
            ImportError: the ``mcp`` SDK is not installed (the ``environments`` extra).
            RuntimeError: the server did not start, or did not list its tools, within ``startup_timeout_s``
                (the message names the command and the cause).
        """
        from mcp import ClientSession, StdioServerParameters, stdio_client

        await self.close()
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._stop = stop = asyncio.Event()
        params = StdioServerParameters(command=self.command[0], args=self.command[1:], env=self.env, cwd=self.cwd)

        async def own() -> None:
            # the stdio transport and the session are task-scoped (anyio): one task holds them open until close()
            try:
                async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
                    await session.initialize()
                    listed = await session.list_tools()
                    self._session = session
                    ready.set_result(listed.tools)
                    await stop.wait()
            except BaseException as e:  # noqa: BLE001  told to start(), which raises it
                if not ready.done():
                    ready.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
                if not isinstance(e, Exception):
                    raise
            finally:
                self._session = None

        self._owner = asyncio.ensure_future(own())
        try:
            tools = await asyncio.wait_for(asyncio.shield(ready), self.startup_timeout_s)
        except Exception as e:
            await self.close()
            what = "timed out" if isinstance(e, TimeoutError) else f"failed: {type(e).__name__}: {e}"
            raise RuntimeError(f"MCP server {self.command}: starting and listing its tools {what}") from None
        return [FunctionTool(name=t.name, description=t.description or "",
                             parameters=t.input_schema, call=self._caller(t.name)) for t in tools]

    def _caller(self, name: str):
        async def call(arguments: dict[str, Any]) -> str:
            return await self.call(name, arguments)
        return call

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Call tool ``name``: its text content (text blocks joined by newlines; structured content as JSON when
        there is no text), ``error: ...`` when the tool reports an error or the call times out.

        Raises:
            RuntimeError: the server is not started (or has stopped).
        """
        if self._session is None:
            raise RuntimeError(f"MCP server {self.command} is not running")
        try:
            result = await asyncio.wait_for(self._session.call_tool(name, arguments), self.call_timeout_s)
        except TimeoutError:
            return f"error: {name} timed out after {self.call_timeout_s} s"
        texts = [block.text for block in result.content if getattr(block, "type", None) == "text"]
        text = "\n".join(texts)
        if not texts and result.structured_content is not None:
            text = json.dumps(result.structured_content)
        return f"error: {text}" if result.is_error else text

    async def close(self) -> None:
        """Close the session and stop the server (it is a no-op when not started)."""
        if self._owner is None:
            return
        if self._stop is not None:
            self._stop.set()
        owner, self._owner = self._owner, None
        try:
            await asyncio.wait_for(owner, self.startup_timeout_s)
        except (TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001  closing: nothing left to tell
            owner.cancel()

"""TCP ports for the local servers a run or a test starts (vLLM, SGLang, the search tool, stores)."""
from __future__ import annotations

import socket

from aiohttp import web


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing was bound to a moment ago (the kernel's choice of an ephemeral port).

    Another process can take it before the caller binds it: a server started on it must be ready to fail to bind
    (as :meth:`producers.vllm_server.VLLMServer.wait_healthy` is: it starts again on another port).

    Raises:
        OSError: ``host`` is not an address of this machine.
    """
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


async def listen(runner: web.AppRunner, host: str, port: int) -> int:
    """Set up aiohttp ``runner`` and listen on ``host``:``port`` (0: a port the kernel picks); returns the port bound.

    Raises:
        OSError: the port cannot be bound (the runner is cleaned up).
    """
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError:
        await runner.cleanup()
        raise
    return runner.addresses[0][1]

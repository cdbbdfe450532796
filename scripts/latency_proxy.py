#!/usr/bin/env python
"""A TCP forwarder that adds a fixed latency, for a simulated long-distance link.

Each mapping ``LISTEN_HOST:LISTEN_PORT=TARGET_HOST:TARGET_PORT`` accepts connections on the listen
address and opens one to the target per connection. Every chunk read on either side is written to the
other side ``one_way_s`` seconds after it was read, in order: a request/response round trip through the
proxy costs ``2 * one_way_s`` (the RTT) more, while a bulk transfer keeps its throughput (chunks are
pipelined, not sent one per RTT). The first chunk of a connection towards the target is held until one
RTT after the accept, so that opening a connection costs one RTT as TCP's handshake does over a real link.

Not modelled: TCP's window and slow start over the long RTT (the proxy's own TCP legs see the local RTT),
and loss. A bandwidth limit is not the proxy's job either: shape the path with ``tc`` (see
``scripts/bench_crossregion.py``).

    python scripts/latency_proxy.py --one-way-ms 150 127.0.0.1:9092=10.0.0.1:9092 [...]

prints ``ready`` on stdout once every mapping listens, and runs until killed. Half-closes are forwarded
(after the same delay); a connection ends when both directions have.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass

CHUNK = 1 << 16


@dataclass(frozen=True)
class Mapping:
    """One forwarded address: connections to ``listen`` go to ``target`` (each a ``(host, port)`` pair)."""

    listen: tuple[str, int]
    target: tuple[str, int]

    @classmethod
    def parse(cls, spec: str) -> "Mapping":
        """``LISTEN_HOST:LISTEN_PORT=TARGET_HOST:TARGET_PORT`` (IPv4 addresses or host names).

        Raises:
            ValueError: ``spec`` is not of that form.
        """
        try:
            listen, target = spec.split("=")
            (lh, lp), (th, tp) = listen.rsplit(":", 1), target.rsplit(":", 1)
            return cls((lh, int(lp)), (th, int(tp)))
        except ValueError:
            raise ValueError(f"mapping {spec!r} must be LISTEN_HOST:LISTEN_PORT=TARGET_HOST:TARGET_PORT") from None


async def _delayed_pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, one_way_s: float,
                        not_before: float, window: int) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``one_way_s`` after it was read (and not before the loop
    time ``not_before`` plus ``one_way_s``), in order; at most ``window`` bytes are held at a time (reading
    waits), and EOF is forwarded as a half-close."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
    held = 0
    room = asyncio.Event()
    room.set()

    async def read_side() -> None:
        nonlocal held
        while True:
            await room.wait()
            try:
                data = await reader.read(CHUNK)
            except OSError:  # reset: forwarded as an end
                data = b""
            queue.put_nowait((max(loop.time(), not_before) + one_way_s, data))
            if not data:
                return
            held += len(data)
            if held >= window:
                room.clear()

    async def write_side() -> None:
        nonlocal held
        while True:
            due, data = await queue.get()
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
            held -= len(data)
            if held < window:
                room.set()

    reading = asyncio.ensure_future(read_side())
    try:
        await write_side()
    except OSError:  # the other side is gone: nothing more to deliver
        pass
    finally:
        reading.cancel()


async def _serve_one(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, target: tuple[str, int],
                     one_way_s: float, window: int) -> None:
    """Forward one accepted connection to ``target`` both ways with the delay; closes both ends at the end."""
    accepted = asyncio.get_running_loop().time()
    try:
        server_r, server_w = await asyncio.open_connection(*target)
    except OSError:
        client_w.close()
        return
    try:
        await asyncio.gather(
            _delayed_pipe(client_r, server_w, one_way_s, accepted + 2 * one_way_s, window),
            _delayed_pipe(server_r, client_w, one_way_s, accepted, window))
    finally:
        for w in (client_w, server_w):
            w.close()


async def serve(mappings: list[Mapping], one_way_s: float, window: int = 16 << 20,
                ready: asyncio.Event | None = None) -> None:
    """Run the proxy for ``mappings`` until cancelled.

    Args:
        mappings: what to listen on and where to forward.
        one_way_s: the delay added in each direction, seconds (>= 0; the RTT grows by twice it).
        window: bytes held per direction and connection before reading pauses (a bound on memory; at
            least rate x one-way delay, or it caps the throughput as a TCP window would).
        ready: set once every mapping listens.

    Raises:
        ValueError: ``one_way_s`` < 0 or ``window`` < 1.
        OSError: a listen address cannot be bound.
    """
    if one_way_s < 0 or window < 1:
        raise ValueError(f"one_way_s must be >= 0 and window >= 1, got {one_way_s} and {window}")
    servers = []
    try:
        for m in mappings:
            servers.append(await asyncio.start_server(
                lambda r, w, target=m.target: _serve_one(r, w, target, one_way_s, window), *m.listen,
                reuse_address=True))
        if ready is not None:
            ready.set()
        await asyncio.gather(*(s.serve_forever() for s in servers))
    finally:
        for s in servers:
            s.close()


def main() -> None:
    """Command-line entry point: parse the mappings, print ``ready`` once listening, serve until killed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mappings", nargs="+", type=Mapping.parse, metavar="LISTEN_HOST:PORT=TARGET_HOST:PORT")
    ap.add_argument("--one-way-ms", type=float, default=0.0, help="delay added in each direction (RTT/2), ms")
    ap.add_argument("--window-mb", type=float, default=16.0, help="bytes held per direction and connection, MiB")
    args = ap.parse_args()

    async def run() -> None:
        ready = asyncio.Event()
        task = asyncio.ensure_future(serve(args.mappings, args.one_way_ms / 1000, int(args.window_mb * 2**20),
                                           ready))
        waiter = asyncio.ensure_future(ready.wait())
        await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            waiter.cancel()
            task.result()  # raises the bind error
        print("ready", flush=True)
        await task

    try:
        asyncio.run(run())
    except OSError as e:
        sys.exit(f"latency_proxy: {e}")
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

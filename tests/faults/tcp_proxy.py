"""A TCP forwarder for fault tests: ``python tcp_proxy.py LISTEN_PORT TARGET_PORT`` forwards
127.0.0.1:LISTEN_PORT to 127.0.0.1:TARGET_PORT and prints ``ready`` once listening. Killing it makes
the target unreachable for real (new connections refused, open ones cut); starting it again on the
same port brings the target back."""
import asyncio
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def _handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, target: int) -> None:
    try:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", target)
    except OSError:
        client_w.close()
        return
    await asyncio.gather(_pipe(client_r, server_w), _pipe(server_r, client_w))


async def _main(listen: int, target: int) -> None:
    server = await asyncio.start_server(lambda r, w: _handle(r, w, target), "127.0.0.1", listen,
                                        reuse_address=True)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1]), int(sys.argv[2])))

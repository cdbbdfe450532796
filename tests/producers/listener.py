"""A real TCP listener in the test process, to prove sandboxed code reaches no network (a test helper)."""
import contextlib
import socket
from typing import Iterator


@contextlib.contextmanager
def listener() -> Iterator[tuple[int, list[bool]]]:
    """Listen on 127.0.0.1 (a free port); yields ``(port, reached)``. On exit, ``reached`` holds one bool:
    whether a connection arrived (waiting 0.5 s for it)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.5)
    reached: list[bool] = []
    try:
        yield server.getsockname()[1], reached
        try:
            conn, _ = server.accept()
            conn.close()
            reached.append(True)
        except socket.timeout:
            reached.append(False)
    finally:
        server.close()

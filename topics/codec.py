"""The message codec: msgpack maps compressed with zstd (DESIGN.md, "Message shapes").

Wire format of a value: ``zstd(msgpack({"schema": name, "v": version, "body": {...}}))``.
Numeric arrays inside ``body`` are msgpack ``bin`` holding little-endian buffers.
"""
from __future__ import annotations

import threading
import time
from typing import TypeVar

import msgpack
import pydantic
import zstandard

from topics.schemas import SCHEMAS, Message

M = TypeVar("M", bound=Message)

DEFAULT_LEVEL = 1
MAX_VALUE_BYTES = 1 << 30
# zstd (de)compressor objects are not thread-safe (a trainer encodes metrics while its publisher thread
# encodes announcements), so each thread keeps its own
_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


class MessageError(ValueError):
    """A value that cannot be decoded or validated, with where it came from.

    Attributes:
        topic, partition, offset: the record's origin (``"?"``/-1 when unknown).
        reason: a human-readable reason.
    """

    def __init__(self, reason: str, topic: str = "?", partition: int = -1, offset: int = -1):
        self.reason, self.topic, self.partition, self.offset = reason, topic, partition, offset
        super().__init__(f"bad message at {topic}[{partition}]@{offset}: {reason}")


def encode(msg: Message, level: int = DEFAULT_LEVEL) -> bytes:
    """Encode ``msg`` to wire bytes (msgpack + zstd at ``level``).

    Raises:
        TypeError: ``msg`` is not a registered :class:`Message`.
    """
    if type(msg).SCHEMA not in SCHEMAS:
        raise TypeError(f"{type(msg).__name__} is not a registered message schema")
    body = msg.model_dump(mode="python")
    raw = msgpack.packb({"schema": msg.SCHEMA, "v": msg.VERSION, "body": body}, use_bin_type=True)
    return _compressor(level).compress(raw)


def decode(
    value: bytes | None,
    expect: type[M] | tuple[type[Message], ...] | None = None,
    *,
    topic: str = "?",
    partition: int = -1,
    offset: int = -1,
) -> M:
    """Decode wire bytes into a validated message.

    Args:
        value: the record value.
        expect: the schema class (or classes) the reader accepts; ``None`` accepts any.
        topic, partition, offset: the origin, quoted in errors.

    Raises:
        MessageError: garbage (not zstd or not msgpack), an unknown or unexpected
            schema, a newer schema version than this reader's, or a body that
            fails validation.
    """
    where = dict(topic=topic, partition=partition, offset=offset)
    if not value:
        raise MessageError("empty value", **where)
    try:
        raw = _decompressor().decompress(value, max_output_size=MAX_VALUE_BYTES)
    except zstandard.ZstdError as e:
        raise MessageError(f"not a zstd frame ({e})", **where) from None
    try:
        envelope = msgpack.unpackb(raw, raw=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise MessageError(f"not msgpack ({type(e).__name__}: {e})", **where) from None
    if not isinstance(envelope, dict) or not {"schema", "v", "body"} <= envelope.keys():
        raise MessageError("not an AstraFlow envelope (needs schema, v, body)", **where)
    cls = SCHEMAS.get(envelope["schema"])
    if cls is None:
        raise MessageError(f"unknown schema {envelope['schema']!r}", **where)
    allowed = expect if isinstance(expect, tuple) else (expect,) if expect else None
    if allowed and cls not in allowed:
        names = ", ".join(c.SCHEMA for c in allowed)
        raise MessageError(f"schema {cls.SCHEMA} where {names} was expected", **where)
    if not isinstance(envelope["v"], int) or envelope["v"] > cls.VERSION:
        raise MessageError(f"{cls.SCHEMA} version {envelope['v']!r} is newer than this reader's {cls.VERSION}", **where)
    try:
        return cls.model_validate(envelope["body"])
    except pydantic.ValidationError as e:
        errs = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()[:5])
        raise MessageError(f"invalid {cls.SCHEMA}: {errs}", **where) from None


def headers_for(msg: Message, producer_id: str | None = None) -> dict[str, str]:
    """Kafka headers for ``msg``: its schema, routing metadata and a ``ts_ms`` timestamp."""
    headers = {"schema": msg.SCHEMA, "ts_ms": str(int(time.time() * 1000))}
    headers.update({k: v for k, v in msg.routing().items() if v})
    if producer_id:
        headers.setdefault("producer_id", producer_id)
    return headers

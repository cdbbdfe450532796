"""Bit-exact sparse weight deltas and full snapshots (DESIGN.md, "Weights").

A **delta** from version ``b`` to version ``v`` holds, per tensor, the flat
positions whose bits changed and the *new* values' raw bits. Tensors are
compared bit-exactly through an unsigned-integer view of the same width
(bf16/fp16 -> uint16, fp32 -> uint32, ...), so NaNs, signed zeros and
denormals survive exactly.

Object layout (``delta.zst``), all integers little-endian::

    prefix  : magic b"AFWD", format u16, flags u16, base_version i64,
              version i64, header_len u32                (PREFIX_BYTES bytes)
    header  : msgpack {"sha256", "base_sha256", "tensors": [{name, dtype,
              shape, count, index_bytes, frame_bytes}, ...]}
    frames  : one zstd frame per tensor with count > 0, in header order

A frame decompresses to ``gaps || values``: ``gaps`` is ``count`` unsigned
integers of ``index_bytes`` bytes (first flat index, then the differences
between consecutive sorted indices), ``values`` is ``count`` raw elements of
the tensor's width. Both arrays are stored *byte-plane split* (all low bytes,
then the next byte, ...): gaps are small, so their high planes are almost all
zero, and bf16 values share their exponent byte, which zstd then shrinks to a
fraction of a byte per element. Frames carry zstd's content checksum, so a
flipped bit in storage is detected before anything is applied.

The ``sha256`` in the header is :func:`state_sha256` of the *resulting* full
parameters (sha256 over per-tensor xxh3-128 digests), the value
:class:`topics.schemas.WeightAnnouncement` carries.

A **full snapshot** is a safetensors file whose metadata holds ``version`` and
``sha256``.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, MutableMapping

import msgpack
import numpy as np
import torch
import xxhash
import zstandard

MAGIC = b"AFWD"
FORMAT = 1
_PREFIX = struct.Struct("<4sHHqqI")
#: Bytes to read from the start of a delta object to learn its base version and version.
PREFIX_BYTES = _PREFIX.size
#: Hard cap on one decompressed frame, bytes (guards against a malformed object).
MAX_FRAME_BYTES = 1 << 40

#: Frames at least this large are compressed by zstd's worker threads; below it threads cost more than they save.
MT_MIN_BYTES = 8 << 20

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.bfloat16, torch.float16, torch.float32, torch.float64,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)}
#: dtype -> (same-width torch integer dtype, numpy unsigned dtype)
_VIEWS = {d: (_TORCH_INT[d.itemsize], _UINT[d.itemsize]) for d in _DTYPES.values()}


class WeightFormatError(ValueError):
    """A delta or snapshot object is malformed, truncated, corrupt, or does not fit the tensors."""


class ChecksumMismatch(WeightFormatError):
    """The parameters after applying an object do not hash to the expected sha256; nothing was changed."""


def dtype_name(t: torch.Tensor) -> str:
    """The dtype of ``t`` as written in headers, e.g. ``"bfloat16"``."""
    return str(t.dtype).removeprefix("torch.")


def bits(t: torch.Tensor) -> np.ndarray:
    """A flat unsigned-integer numpy view of ``t``'s raw bits (no copy).

    Args:
        t: a contiguous CPU tensor of any supported dtype (see ``_DTYPES``), any shape.

    Returns:
        uint8/uint16/uint32/uint64 array of shape ``(t.numel(),)`` sharing ``t``'s memory.

    Raises:
        WeightFormatError: ``t`` is not on the CPU, not contiguous, or of an unsupported dtype.
    """
    views = _VIEWS.get(t.dtype)
    if views is None:
        raise WeightFormatError(f"unsupported dtype {t.dtype}")
    if t.device.type != "cpu" or not t.is_contiguous():
        raise WeightFormatError(f"need a contiguous CPU tensor, got device {t.device}, contiguous={t.is_contiguous()}")
    return t.view(views[0]).numpy().reshape(-1).view(views[1])


class StateHasher:
    """Incremental :func:`state_sha256`: feed tensors in sorted-name order with :meth:`update`."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def update(self, name: str, t: torch.Tensor, raw: np.ndarray | None = None) -> None:
        """Add tensor ``name``; ``raw`` is ``bits(t)`` when the caller already has it."""
        self._h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        self._h.update(xxhash.xxh3_128_digest(bits(t) if raw is None else raw))

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def state_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """The checksum of a full parameter set, 64 hex characters.

    sha256 over, per tensor in sorted-name order, its name, torch dtype and
    shape tuple as NUL-terminated UTF-8 strings, then the 16-byte xxh3-128
    digest of its raw bytes. Hashing the bytes with xxh3 (about 10 GB/s) instead of sha256 (about
    1.5 GB/s) keeps verification far below memcpy time; the outer sha256 binds
    names, shapes and dtypes too. This is the value carried by
    ``WeightAnnouncement.sha256``, delta headers and snapshot metadata.
    """
    h = StateHasher()
    for name in sorted(tensors):
        h.update(name, tensors[name])
    return h.hexdigest()


def _split_into(out: np.ndarray, arr: np.ndarray) -> None:
    """Byte-plane split of a 1-D integer array (n,) of width w into ``out`` (w*n,) uint8, plane by plane."""
    out.reshape(arr.itemsize, -1)[:] = arr.view(np.uint8).reshape(-1, arr.itemsize).T


def _join(buf: np.ndarray, width: int, count: int) -> np.ndarray:
    """Inverse of :func:`_split_into`: (width*count,) uint8 -> (count,) unsigned ints of ``width`` bytes."""
    return np.ascontiguousarray(buf.reshape(width, count).T).view(_UINT[width]).reshape(-1)


@dataclass
class Delta:
    """An encoded delta and what was measured while making it.

    ``data`` is the whole ``delta.zst`` object (bytes); ``changed`` and
    ``total`` count elements; ``sparsity`` = 1 - changed/total.
    """

    data: bytes
    base_version: int
    version: int
    sha256: str
    changed: int
    total: int

    @property
    def sparsity(self) -> float:
        return 1.0 - self.changed / self.total if self.total else 1.0


def encode_delta(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *,
                 base_version: int, version: int, level: int = 1, threads: int = -1,
                 base_sha256: str | None = None, max_bytes: int | None = None) -> Delta | None:
    """Encode the bit-exact sparse delta turning ``old`` into ``new``.

    Works tensor by tensor: peak extra memory is about 20 bytes per element of
    the largest tensor (mask, indices, gaps) plus the compressed output.

    Args:
        old, new: the same names, shapes and dtypes; contiguous CPU tensors.
        base_version, version: the versions of ``old`` and ``new`` (``base_version < version``).
        level: zstd level (1-22). Level 1 is the default: on bf16 deltas it
            comes within about 4% of level 3's size at about twice the speed.
            ``threads``: zstd worker threads for frames of at
            least ``MT_MIN_BYTES`` (-1: one per core).
        base_sha256: :func:`state_sha256` of ``old`` if known; recorded so that a
            reader can refuse to apply the delta to the wrong base.
        max_bytes: give up and return ``None`` once the output exceeds this many
            bytes (the caller then prefers a full snapshot).

    Returns:
        The :class:`Delta`, or ``None`` when ``max_bytes`` was exceeded.

    Raises:
        WeightFormatError: names, shapes or dtypes differ, or versions are not increasing.
    """
    if set(old) != set(new):
        raise WeightFormatError(f"tensor names differ: only old {sorted(set(old) - set(new))[:5]}, "
                                f"only new {sorted(set(new) - set(old))[:5]}")
    if base_version >= version:
        raise WeightFormatError(f"a delta needs base_version < version, got {base_version} -> {version}")
    comp = zstandard.ZstdCompressor(level=level, write_checksum=True)
    comp_mt = zstandard.ZstdCompressor(level=level, threads=threads, write_checksum=True)
    h = StateHasher()
    entries, frames, size, changed, total = [], [], 0, 0, 0
    mask = np.empty(max((t.numel() for t in new.values()), default=0), dtype=bool)
    for name in sorted(new):
        a, b = old[name], new[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise WeightFormatError(f"tensor {name!r}: old {tuple(a.shape)} {a.dtype} vs new {tuple(b.shape)} {b.dtype}")
        ab, bb = bits(a), bits(b)
        h.update(name, b, bb)
        idx = np.flatnonzero(np.not_equal(ab, bb, out=mask[:bb.size]))
        entry = {"name": name, "dtype": dtype_name(b), "shape": list(b.shape), "count": int(idx.size),
                 "index_bytes": 0, "frame_bytes": 0}
        if idx.size:
            gaps = np.empty_like(idx)
            gaps[0] = idx[0]
            np.subtract(idx[1:], idx[:-1], out=gaps[1:])
            width = next(w for w in (1, 2, 4, 8) if int(gaps.max()) < (1 << (8 * w)))
            payload = np.empty(idx.size * (width + bb.itemsize), np.uint8)
            _split_into(payload[:idx.size * width], gaps.astype(_UINT[width]))
            _split_into(payload[idx.size * width:], bb[idx])
            frame = (comp_mt if payload.size >= MT_MIN_BYTES else comp).compress(payload)
            frames.append(frame)
            entry.update(index_bytes=width, frame_bytes=len(frame))
            size += len(frame)
            if max_bytes is not None and size > max_bytes:
                return None
        entries.append(entry)
        changed += int(idx.size)
        total += bb.size
    sha = h.hexdigest()
    header = msgpack.packb({"sha256": sha, "base_sha256": base_sha256, "tensors": entries}, use_bin_type=True)
    prefix = _PREFIX.pack(MAGIC, FORMAT, 0, base_version, version, len(header))
    return Delta(b"".join([prefix, header, *frames]), base_version, version, sha, changed, total)


@dataclass
class DeltaHeader:
    """The parsed prefix and header of a delta object."""

    base_version: int
    version: int
    sha256: str
    base_sha256: str | None
    tensors: list[dict]
    frames_offset: int = field(repr=False, default=0)


def read_prefix(data: bytes) -> tuple[int, int, int]:
    """Parse the fixed prefix of a delta object: ``(base_version, version, header_len)``.

    Raises:
        WeightFormatError: too short, wrong magic, or an unknown format number.
    """
    if len(data) < PREFIX_BYTES:
        raise WeightFormatError(f"delta object is {len(data)} bytes, shorter than its {PREFIX_BYTES}-byte prefix")
    magic, fmt, _flags, base, version, hlen = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise WeightFormatError(f"not a delta object (magic {magic!r}, expected {MAGIC!r})")
    if fmt != FORMAT:
        raise WeightFormatError(f"delta format {fmt} is not supported (this reader knows {FORMAT})")
    return base, version, hlen


def read_header(data: bytes) -> DeltaHeader:
    """Parse a delta object's prefix and msgpack header.

    Raises:
        WeightFormatError: the prefix or header is malformed, or frame sizes do not add up to the object size.
    """
    base, version, hlen = read_prefix(data)
    end = PREFIX_BYTES + hlen
    try:
        head = msgpack.unpackb(bytes(data[PREFIX_BYTES:end]), raw=False)
        tensors = head["tensors"]
        need = sum(int(t["frame_bytes"]) for t in tensors)
        for t in tensors:
            if t["dtype"] not in _DTYPES or t["count"] < 0 or (t["count"] and t["index_bytes"] not in _UINT):
                raise ValueError(f"bad entry for {t.get('name')!r}")
        hdr = DeltaHeader(base, version, head["sha256"], head.get("base_sha256"), tensors, end)
    except Exception as e:  # msgpack and KeyError/TypeError on garbage
        raise WeightFormatError(f"delta {base}->{version}: malformed header ({type(e).__name__}: {e})") from None
    if len(data) != end + need:
        raise WeightFormatError(f"delta {base}->{version}: object is {len(data)} bytes, header says {end + need} (truncated?)")
    return hdr


def apply_delta(data: bytes, tensors: MutableMapping[str, torch.Tensor], *,
                expect_sha256: str | None = None, base_sha256: str | None = None) -> DeltaHeader:
    """Apply a delta object to ``tensors`` in place, then verify the result.

    The changed elements' old bits are kept as an undo log (same size as the
    delta's values), so on any failure every tensor is restored bit-exactly:
    the caller sees either the verified new version or its old one.

    Args:
        data: the ``delta.zst`` object.
        tensors: the base version's tensors (contiguous CPU), modified in place.
        expect_sha256: the sha256 the result must have (e.g. from the
            announcement); the header's own value is always checked too.
        base_sha256: :func:`state_sha256` of ``tensors`` if known; checked
            against the header's recorded base before anything is touched.

    Returns:
        The delta's header.

    Raises:
        WeightFormatError: malformed/corrupt object, or it does not fit ``tensors``
            (names, shapes, dtypes, base checksum). ``tensors`` are unchanged.
        ChecksumMismatch: the result's sha256 is wrong; ``tensors`` were restored.
    """
    hdr = read_header(data)
    label = f"delta {hdr.base_version}->{hdr.version}"
    if expect_sha256 is not None and expect_sha256 != hdr.sha256:
        raise ChecksumMismatch(f"{label}: header sha256 {hdr.sha256[:12]} != expected {expect_sha256[:12]}")
    if base_sha256 and hdr.base_sha256 and base_sha256 != hdr.base_sha256:
        raise WeightFormatError(f"{label}: local base sha256 {base_sha256[:12]} != the delta's base {hdr.base_sha256[:12]}")
    names = {t["name"] for t in hdr.tensors}
    if names != set(tensors):
        raise WeightFormatError(f"{label}: tensor names differ from the local ones "
                                f"(missing locally {sorted(names - set(tensors))[:5]}, extra {sorted(set(tensors) - names)[:5]})")
    for t in hdr.tensors:
        local = tensors[t["name"]]
        if list(local.shape) != list(t["shape"]) or dtype_name(local) != t["dtype"]:
            raise WeightFormatError(f"{label}: tensor {t['name']!r} is {t['shape']} {t['dtype']} in the delta, "
                                    f"{list(local.shape)} {dtype_name(local)} locally")
    dec = zstandard.ZstdDecompressor()
    undo: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    pos = hdr.frames_offset
    try:
        for t in hdr.tensors:
            if not t["count"]:
                continue
            flat = bits(tensors[t["name"]])
            n, iw, vw = t["count"], t["index_bytes"], flat.itemsize
            frame = data[pos:pos + t["frame_bytes"]]
            pos += t["frame_bytes"]
            try:
                raw = np.frombuffer(dec.decompress(frame, max_output_size=MAX_FRAME_BYTES), np.uint8)
            except zstandard.ZstdError as e:
                raise WeightFormatError(f"{label}: tensor {t['name']!r}: corrupt zstd frame ({e})") from None
            if raw.size != n * (iw + vw):
                raise WeightFormatError(f"{label}: tensor {t['name']!r}: frame holds {raw.size} bytes, expected {n * (iw + vw)}")
            idx = np.cumsum(_join(raw[:n * iw], iw, n), dtype=np.int64)
            if idx.min() < 0 or idx.max() >= flat.size:
                raise WeightFormatError(f"{label}: tensor {t['name']!r}: index out of range ({flat.size} elements)")
            undo.append((flat, idx, flat[idx]))
            flat[idx] = _join(raw[n * iw:], vw, n)
        got = state_sha256(tensors)
        if got != hdr.sha256:
            raise ChecksumMismatch(f"{label}: result sha256 {got[:12]} != {hdr.sha256[:12]} (local base is not version "
                                   f"{hdr.base_version}, or the object is corrupt); local weights restored")
    except Exception:
        for flat, idx, old in reversed(undo):
            flat[idx] = old
        raise
    return hdr


def save_full(tensors: Mapping[str, torch.Tensor], path: str | Path, *, version: int, sha256: str | None = None) -> str:
    """Write a full snapshot (safetensors) of ``tensors`` to ``path``.

    Returns:
        The :func:`state_sha256` of ``tensors`` (recorded in the file's metadata).
    """
    from safetensors.torch import save_file

    sha = sha256 or state_sha256(tensors)
    save_file(dict(tensors), str(path), metadata={"version": str(version), "sha256": sha, "format": "astraflow-full-1"})
    return sha


def load_full(path: str | Path, into: MutableMapping[str, torch.Tensor] | None = None, *,
              expect_sha256: str | None = None) -> tuple[dict[str, torch.Tensor] | MutableMapping[str, torch.Tensor], int, str]:
    """Read and verify a full snapshot, then load it.

    Pass 1 hashes the file's tensors (memory-mapped, one tensor at a time);
    only if the sha256 matches the metadata (and ``expect_sha256``) does pass 2
    copy them into ``into`` (or return fresh tensors when ``into`` is None).

    Returns:
        ``(tensors, version, sha256)``.

    Raises:
        WeightFormatError: unreadable file, missing metadata, or names/shapes/dtypes that do not match ``into``.
        ChecksumMismatch: the tensors do not hash to the recorded or expected sha256; ``into`` is unchanged.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if "sha256" not in meta or "version" not in meta:
                raise WeightFormatError(f"snapshot {path}: metadata lacks sha256/version (got {sorted(meta)})")
            names = sorted(f.keys())
            if into is not None and set(names) != set(into):
                raise WeightFormatError(f"snapshot {path}: tensor names differ from the local ones "
                                        f"(missing locally {sorted(set(names) - set(into))[:5]}, extra {sorted(set(into) - set(names))[:5]})")
            h = StateHasher()
            for name in names:
                t = f.get_tensor(name)
                if into is not None and (into[name].shape != t.shape or into[name].dtype != t.dtype):
                    raise WeightFormatError(f"snapshot {path}: tensor {name!r} is {tuple(t.shape)} {t.dtype}, "
                                            f"locally {tuple(into[name].shape)} {into[name].dtype}")
                h.update(name, t)
            got = h.hexdigest()
            for want in (meta["sha256"], expect_sha256):
                if want is not None and got != want:
                    raise ChecksumMismatch(f"snapshot {path}: sha256 {got[:12]} != {want[:12]}; not loaded")
            out: MutableMapping[str, torch.Tensor] = {} if into is None else into
            for name in names:
                if into is None:
                    out[name] = f.get_tensor(name)
                else:
                    into[name].copy_(f.get_tensor(name))
    except WeightFormatError:
        raise
    except Exception as e:  # safetensors raises SafetensorError/OSError on a bad file
        raise WeightFormatError(f"snapshot {path}: unreadable ({type(e).__name__}: {e})") from None
    return out, int(meta["version"]), got


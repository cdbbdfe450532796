"""Bit-exact sparse weight deltas and full snapshots (DESIGN.md, "Weights").

A **delta** from version ``b`` to version ``v`` holds, per tensor, the flat
positions whose bits changed and the changed values. Tensors are compared
bit-exactly through an unsigned-integer view of the same width (bf16/fp16 ->
uint16, fp32 -> uint32, ...), so NaNs, signed zeros, denormals and infinities
survive exactly.

Object layout (``delta.zst``), all integers little-endian::

    prefix  : magic b"AFWD", format u16, flags u16, base_version i64,
              version i64, header_len u32            (PREFIX_BYTES bytes)
    header  : msgpack {"sha256", "base_sha256", "tensors": [entry, ...]}
    check   : xxh3-64 of all the other bytes, u64     (format 2 only)
    frames  : per tensor with count > 0, in header order, its zstd frames

Format 2 (written) codes each tensor's positions and values independently, each
the smallest of its candidates as measured by compressing them (values of a
tensor with over :data:`VALUE_SAMPLE` changes: measured on its first ones):

- positions ``"gaps"``: ``count`` unsigned integers of ``index_bytes`` bytes
  (the first flat index, then the differences of consecutive sorted indices);
  ``"bitmap"``: one bit per element, little bit order (tried only when the raw
  bitmap is smaller than the raw gaps, i.e. a dense tensor);
- values ``"raw"``: the new bits; ``"xor"``: new XOR base; ``"diff"``: the
  zigzag of ``new - base`` as same-width integers (wrapping), so that a change
  of +-k units in the last place costs about log2(k)+1 bits. ``"xor"`` and
  ``"diff"`` need the exact base: the header records the base's checksum and
  :func:`apply_delta` refuses another base (:class:`BaseMismatch`).

Entry: ``{name, dtype, shape, count, positions, index_bytes, values,
frame_bytes: [positions frame, values frame]}``. Integer arrays are stored
*byte-plane split* (all low bytes, then the next byte, ...): small gaps and
small differences leave their high planes almost all zero, which zstd shrinks to
nearly nothing, and the low planes go through its Huffman coder. Level 1 is the
default: on bf16 deltas level 3 is no smaller and half as fast
(``scripts/bench_weights.py``). At level 1 the match finder is cut down
(:data:`FAST_PARAMETERS`): these planes hold few real repeats, and short matches
found in noise cost more than the literals they replace.

Format 1 (read only, written until 2026-12): entry ``{name, dtype, shape,
count, index_bytes, frame_bytes}``, one frame per tensor holding ``gaps ||
raw values``, no object check.

In format 2 the check covers every other byte of the object (format 1: each
frame carries zstd's content checksum), so a flipped bit in storage is detected
before anything is applied. The ``sha256`` in the header is
:func:`state_sha256` of the *resulting* full parameters (sha256 over
per-tensor xxh3-128 digests), the value
:class:`topics.schemas.WeightAnnouncement` carries.

Finding a tensor's changed elements and applying them are compiled loops
(:mod:`weights.kernels`).

A **full snapshot** is a safetensors file whose metadata holds ``version`` and
``sha256``.
"""
from __future__ import annotations

import hashlib
import json
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
#: The delta format this code writes.
FORMAT = 2
#: The delta formats this code reads (format 1: objects written before format 2).
READ_FORMATS = (1, 2)
_PREFIX = struct.Struct("<4sHHqqI")
#: Bytes to read from the start of a delta object to learn its base version and version (any format).
PREFIX_BYTES = _PREFIX.size
_CHECK = struct.Struct("<Q")

#: Frames at least this large are compressed by zstd's worker threads; below it threads cost more than they save.
MT_MIN_BYTES = 8 << 20

#: Codings of a tensor's changed positions (format 2; module docstring).
POSITIONS = ("gaps", "bitmap")
#: Codings of a tensor's changed values (format 2; module docstring).
VALUES = ("raw", "xor", "diff")
#: Value codings that need the exact base to decode.
BASE_RELATIVE = frozenset({"xor", "diff"})
#: A tensor with more changes than this picks its value coding on its first this many.
VALUE_SAMPLE = 1 << 10

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


class BaseMismatch(WeightFormatError):
    """The local weights are not the delta's base (their checksum differs from the base checksum the delta
    records); nothing was changed. The object is sound: another path (a full snapshot) is needed."""


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

    def update(self, name: str, t: torch.Tensor, raw: np.ndarray | None = None, digest: bytes | None = None) -> None:
        """Add tensor ``name``; ``raw`` is ``bits(t)`` and ``digest`` the xxh3-128 digest of its bytes when the
        caller already has them."""
        self._h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        self._h.update(digest or xxhash.xxh3_128_digest(bits(t) if raw is None else raw))

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


def _kernels():
    """:mod:`weights.kernels`, imported on first use: importing numba takes ~0.4 s, which processes that never
    encode or decode a delta (the launcher, the CLI) do not pay."""
    from weights import kernels

    return kernels


def warm_kernels() -> None:
    """Load the compiled kernels now, by encoding and applying a 1,024-element float32 delta.

    Importing numba and loading its cached kernels costs ~1 CPU-second on this project's 2-core machine (0.5-0.7 s
    of import, 0.4 s of the first call), once per process. A trainer's first delta attempt paid it in the middle of
    its second step, inside the run's steady state; the publisher calls this as its thread starts, while the
    trainer loads its model and waits for its first batch.
    """
    old = {"warm": torch.zeros(1024, dtype=torch.float32)}
    new = {"warm": old["warm"].clone()}
    new["warm"][::7] = 1.0
    delta = encode_delta(old, new, base_version=0, version=1)
    apply_delta(delta.data, old)


def _value_payloads(old: np.ndarray, new: np.ndarray, codings=VALUES) -> dict[str, np.ndarray]:
    """The byte-plane split values (itemsize * n,) uint8 of each coding in ``codings`` (module docstring), from
    old and new bits (n,)."""
    return {c: _kernels().value_planes(old, new, c).reshape(-1) for c in codings}


@dataclass
class Delta:
    """An encoded delta and what was measured while making it.

    ``data`` is the whole ``delta.zst`` object (bytes); ``changed`` and
    ``total`` count elements; ``sparsity`` = 1 - changed/total; ``codings``
    counts the tensors per ``"positions+values"`` coding, e.g. ``{"gaps+diff": 30}``.
    """

    data: bytes
    base_version: int
    version: int
    sha256: str
    changed: int
    total: int
    codings: dict[str, int] = field(default_factory=dict)

    @property
    def sparsity(self) -> float:
        return 1.0 - self.changed / self.total if self.total else 1.0


#: zstd's parameters at level 1: its fast strategy with a 64-entry hash table (stock: 16 Ki entries) and 7-byte
#: minimum matches. On the byte planes of bf16 deltas at lr 1e-6 (``scripts/bench_weights.py``'s model) this
#: compresses 15% faster than stock level 1 and 2% smaller.
FAST_PARAMETERS = dict(window_log=18, hash_log=6, chain_log=6, search_log=1, min_match=7, target_length=0,
                       strategy=zstandard.STRATEGY_FAST)


class _Frames:
    """zstd compression of one delta's frames: one-shot below ``MT_MIN_BYTES``, zstd's worker threads above."""

    def __init__(self, level: int, threads: int):
        def compressor(workers: int) -> zstandard.ZstdCompressor:
            # the object's own check covers the frames: zstd's content checksum would only cost time
            if level == 1:
                return zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(
                    threads=workers, write_checksum=0, **FAST_PARAMETERS))
            return zstandard.ZstdCompressor(level=level, threads=workers, write_checksum=False)

        self._one, self._mt = compressor(0), compressor(threads)

    def compress(self, payload: np.ndarray) -> bytes:
        return (self._mt if payload.size >= MT_MIN_BYTES else self._one).compress(payload)

    def smallest(self, candidates: dict[str, np.ndarray]) -> tuple[str, bytes]:
        """The candidate (name -> uint8 payload) whose frame is smallest, and that frame."""
        frames = {name: self.compress(p) for name, p in candidates.items()}
        best = min(frames, key=lambda name: len(frames[name]))
        return best, frames[best]

    def values(self, old: np.ndarray, new: np.ndarray, only: str | None = None) -> tuple[str, bytes]:
        """The smallest value coding (or ``only``) of a tensor's changed elements (old and new bits, (n,)),
        and its frame.

        Beyond :data:`VALUE_SAMPLE` changes the codings are compared on the first :data:`VALUE_SAMPLE`
        (a tensor's changes are alike along it), and only the smallest is compressed whole.
        """
        if only is not None:
            return only, self.compress(_value_payloads(old, new, (only,))[only])
        if old.size <= VALUE_SAMPLE:
            return self.smallest(_value_payloads(old, new))
        best, _ = self.smallest(_value_payloads(old[:VALUE_SAMPLE], new[:VALUE_SAMPLE]))
        return best, self.compress(_value_payloads(old, new, (best,))[best])


def encode_delta(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *,
                 base_version: int, version: int, level: int = 1, threads: int = -1,
                 base_sha256: str | None = None, max_bytes: int | None = None,
                 coding: tuple[str, str] | None = None) -> Delta | None:
    """Encode the bit-exact sparse delta turning ``old`` into ``new`` (format :data:`FORMAT`).

    Works tensor by tensor: peak extra memory is about 50 bytes per changed element
    of the tensor with the most changes (the scan's buffers, gaps, values and their
    codings; at least 24 MB) and the compressed output. Each tensor's positions and values
    take their smallest coding (module docstring).

    Args:
        old, new: the same names, shapes and dtypes; contiguous CPU tensors.
        base_version, version: the versions of ``old`` and ``new`` (``base_version < version``).
        level: zstd level (1-22); 1 by measurement (module docstring).
            ``threads``: zstd worker threads for frames of at
            least ``MT_MIN_BYTES`` (-1: one per core).
        base_sha256: :func:`state_sha256` of ``old`` if known (the publisher has it); else it is
            computed here. Recorded so that a reader refuses to apply the delta to another base.
        max_bytes: give up and return ``None`` once the output exceeds this many
            bytes (the caller then prefers a full snapshot).
        coding: ``(positions, values)`` from :data:`POSITIONS` x :data:`VALUES` to use for every
            tensor instead of the smallest (tests; the benchmark's baseline is ``("gaps", "raw")``).

    Returns:
        The :class:`Delta`, or ``None`` when ``max_bytes`` was exceeded.

    Raises:
        WeightFormatError: names, shapes or dtypes differ, versions are not increasing, or ``coding`` is unknown.
    """
    if set(old) != set(new):
        raise WeightFormatError(f"tensor names differ: only old {sorted(set(old) - set(new))[:5]}, "
                                f"only new {sorted(set(new) - set(old))[:5]}")
    if base_version >= version:
        raise WeightFormatError(f"a delta needs base_version < version, got {base_version} -> {version}")
    if coding is not None and (coding[0] not in POSITIONS or coding[1] not in VALUES):
        raise WeightFormatError(f"coding {coding!r} is not one of {POSITIONS} x {VALUES}")
    frames_of = _Frames(level, threads)
    h = StateHasher()
    base_h = StateHasher() if base_sha256 is None else None
    entries, frames, size, changed, total, codings = [], [], 0, 0, 0, {}
    kernels = _kernels()
    scan_buffers = kernels.ScanBuffers(1 << 20)  # the scan grows them where a tensor needs more
    for name in sorted(new):
        a, b = old[name], new[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise WeightFormatError(f"tensor {name!r}: old {tuple(a.shape)} {a.dtype} vs new {tuple(b.shape)} {b.dtype}")
        ab, bb = bits(a), bits(b)
        idx, base_values, new_values, digest = kernels.changed_elements(ab, bb, scan_buffers)
        h.update(name, b, digest=digest)
        if base_h is not None:
            base_h.update(name, a, ab)
        entry = {"name": name, "dtype": dtype_name(b), "shape": list(b.shape), "count": int(idx.size)}
        if idx.size:
            gaps = kernels.gap_planes(idx)
            width = gaps.shape[0]
            positions = {}
            if coding is None or coding[0] == "gaps":
                positions["gaps"] = gaps.reshape(-1)
            # the bitmap is tried where it is smaller than the gaps before compression (a dense tensor)
            if (coding is None and bb.size < 8 * positions["gaps"].size) or (coding and coding[0] == "bitmap"):
                changed_mask = np.zeros(bb.size, bool)
                changed_mask[idx] = True
                positions["bitmap"] = np.packbits(changed_mask, bitorder="little")
            pos_coding, pos_frame = frames_of.smallest(positions)
            val_coding, val_frame = frames_of.values(base_values, new_values, None if coding is None else coding[1])
            frames += [pos_frame, val_frame]
            entry.update(positions=pos_coding, index_bytes=width, values=val_coding,
                         frame_bytes=[len(pos_frame), len(val_frame)])
            codings[f"{pos_coding}+{val_coding}"] = codings.get(f"{pos_coding}+{val_coding}", 0) + 1
            size += len(pos_frame) + len(val_frame)
            if max_bytes is not None and size > max_bytes:
                return None
        entries.append(entry)
        changed += int(idx.size)
        total += bb.size
    sha = h.hexdigest()
    header = msgpack.packb({"sha256": sha, "base_sha256": base_sha256 or base_h.hexdigest(), "tensors": entries},
                           use_bin_type=True)
    prefix = _PREFIX.pack(MAGIC, FORMAT, 0, base_version, version, len(header))
    check = xxhash.xxh3_64()
    for part in (prefix, header, *frames):
        check.update(part)
    data = b"".join([prefix, header, _CHECK.pack(check.intdigest()), *frames])
    return Delta(data, base_version, version, sha, changed, total, codings)


@dataclass
class DeltaHeader:
    """The parsed prefix and header of a delta object (``format``: 1 or 2; ``tensors``: the header's entries)."""

    base_version: int
    version: int
    sha256: str
    base_sha256: str | None
    tensors: list[dict]
    frames_offset: int = field(repr=False, default=0)
    format: int = FORMAT

    @property
    def base_relative(self) -> bool:
        """Whether any tensor's values are coded relative to the base (decoding needs the exact base)."""
        return any(t.get("values") in BASE_RELATIVE for t in self.tensors)


def read_prefix(data: bytes) -> tuple[int, int, int]:
    """Parse the fixed prefix of a delta object: ``(base_version, version, header_len)``.

    Raises:
        WeightFormatError: too short, wrong magic, or an unknown format number.
    """
    return _read_prefix(data)[1:]


def _read_prefix(data: bytes) -> tuple[int, int, int, int]:
    """``(format, base_version, version, header_len)``; errors as :func:`read_prefix`."""
    if len(data) < PREFIX_BYTES:
        raise WeightFormatError(f"delta object is {len(data)} bytes, shorter than its {PREFIX_BYTES}-byte prefix")
    magic, fmt, _flags, base, version, hlen = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise WeightFormatError(f"not a delta object (magic {magic!r}, expected {MAGIC!r})")
    if fmt not in READ_FORMATS:
        raise WeightFormatError(f"delta format {fmt} is not supported (this reader knows {READ_FORMATS})")
    return fmt, base, version, hlen


def _check_entry(t: dict, fmt: int) -> int:
    """Validate one header entry; returns the bytes of its frames."""
    if not isinstance(t["name"], str) or t["dtype"] not in _DTYPES or not _natural(t["count"]):
        raise ValueError(f"bad entry for {t.get('name')!r}")
    if not t["count"]:
        return 0
    if not _natural(t["index_bytes"]) or t["index_bytes"] not in _UINT:
        raise ValueError(f"bad index_bytes for {t['name']!r}")
    sizes = [t["frame_bytes"]] if fmt == 1 else t["frame_bytes"]
    if not isinstance(sizes, list) or len(sizes) != (1 if fmt == 1 else 2) or not all(map(_natural, sizes)):
        raise ValueError(f"bad frame_bytes for {t['name']!r}")
    if fmt >= 2 and (t["positions"] not in POSITIONS or t["values"] not in VALUES):
        raise ValueError(f"bad coding for {t['name']!r}")
    return sum(sizes)


def _natural(v) -> bool:
    """``v`` is a non-negative int (not a bool, which Python counts as one)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_header(data: bytes) -> DeltaHeader:
    """Parse a whole delta object's prefix and msgpack header (either format in :data:`READ_FORMATS`).

    Raises:
        WeightFormatError: the prefix or header is malformed, the object is corrupt (format 2: its xxh3
            check), or frame sizes do not add up to the object size.
    """
    fmt, base, version, hlen = _read_prefix(data)
    end = PREFIX_BYTES + hlen
    header = bytes(data[PREFIX_BYTES:end])
    if fmt >= 2:
        view = memoryview(data)
        check = xxhash.xxh3_64(view[:end])
        check.update(view[end + _CHECK.size:])
        if len(data) < end + _CHECK.size or _CHECK.unpack_from(data, end)[0] != check.intdigest():
            raise WeightFormatError(f"delta {base}->{version}: object is corrupt or truncated (its xxh3 check "
                                    f"does not match)")
        end += _CHECK.size
    try:
        head = msgpack.unpackb(header, raw=False)
        tensors = head["tensors"]
        need = sum(_check_entry(t, fmt) for t in tensors)
        hdr = DeltaHeader(base, version, head["sha256"], head.get("base_sha256"), tensors, end, fmt)
    except Exception as e:  # msgpack and KeyError/TypeError on garbage
        raise WeightFormatError(f"delta {base}->{version}: malformed header ({type(e).__name__}: {e})") from None
    if len(data) != end + need:
        raise WeightFormatError(f"delta {base}->{version}: object is {len(data)} bytes, header says {end + need} (truncated?)")
    return hdr


def _decompress(dec: zstandard.ZstdDecompressor, frame, expect: int, what: str) -> np.ndarray:
    """One zstd frame (format 1: its content checksum verified) as a uint8 array of exactly ``expect`` bytes."""
    try:
        declared = zstandard.frame_content_size(frame)  # -1: not in the frame's header
        if declared not in (-1, expect):
            raise WeightFormatError(f"{what}: frame holds {declared} bytes, expected {expect}")
        raw = np.frombuffer(dec.decompress(frame, max_output_size=expect), np.uint8)
    except zstandard.ZstdError as e:
        raise WeightFormatError(f"{what}: corrupt zstd frame ({e})") from None
    if raw.size != expect:
        raise WeightFormatError(f"{what}: frame holds {raw.size} bytes, expected {expect}")
    return raw


def _decode_tensor(dec: zstandard.ZstdDecompressor, data, pos: int, t: dict, flat: np.ndarray, fmt: int,
                   what: str) -> tuple[np.ndarray, np.ndarray, str]:
    """Decompress one tensor's frames at ``data[pos:]``: ``(positions, value planes (itemsize, n) uint8,
    value coding)``, the positions as :func:`weights.kernels.apply_changes` takes them (gap planes
    (index_bytes, n) uint8, or a bitmap (ceil(size / 8),) uint8)."""
    n, iw, vw = t["count"], t["index_bytes"], flat.itemsize
    if n > flat.size:
        raise WeightFormatError(f"{what}: {n} changes in a tensor of {flat.size} elements")
    if fmt == 1:
        raw = _decompress(dec, data[pos:pos + t["frame_bytes"]], n * (iw + vw), what)
        return raw[:n * iw].reshape(iw, n), raw[n * iw:].reshape(vw, n), "raw"
    pos_bytes, val_bytes = t["frame_bytes"]
    if t["positions"] == "gaps":
        positions = _decompress(dec, data[pos:pos + pos_bytes], n * iw, what).reshape(iw, n)
    else:
        positions = _decompress(dec, data[pos:pos + pos_bytes], (flat.size + 7) // 8, what)
    values = _decompress(dec, data[pos + pos_bytes:pos + pos_bytes + val_bytes], n * vw, what).reshape(vw, n)
    return positions, values, t["values"]


def apply_delta(data: bytes, tensors: MutableMapping[str, torch.Tensor], *,
                expect_sha256: str | None = None, base_sha256: str | None = None) -> DeltaHeader:
    """Apply a delta object (either format in :data:`READ_FORMATS`) to ``tensors`` in place, then verify the result.

    The changed elements' old bits are kept as an undo log (same size as the
    delta's values), so on any failure every tensor is restored bit-exactly:
    the caller sees either the verified new version or its old one.

    Args:
        data: the ``delta.zst`` object.
        tensors: the base version's tensors (contiguous CPU), modified in place.
        expect_sha256: the sha256 the result must have (e.g. from the
            announcement); the header's own value is always checked too.
        base_sha256: :func:`state_sha256` of ``tensors`` if known; checked
            against the header's recorded base before anything is touched. Without it a wrong
            base is caught by the result's checksum (and the tensors restored).

    Returns:
        The delta's header.

    Raises:
        BaseMismatch: ``base_sha256`` is not the base the delta was made from; ``tensors`` are unchanged.
        WeightFormatError: malformed/corrupt object, or it does not fit ``tensors``
            (names, shapes, dtypes). ``tensors`` are unchanged.
        ChecksumMismatch: the result's sha256 is wrong; ``tensors`` were restored.
    """
    hdr = read_header(data)
    label = f"delta {hdr.base_version}->{hdr.version}"
    if expect_sha256 is not None and expect_sha256 != hdr.sha256:
        raise ChecksumMismatch(f"{label}: header sha256 {hdr.sha256[:12]} != expected {expect_sha256[:12]}")
    if base_sha256 and hdr.base_sha256 and base_sha256 != hdr.base_sha256:
        raise BaseMismatch(f"{label}: the local weights (sha256 {base_sha256[:12]}) are not version {hdr.base_version} "
                           f"(sha256 {hdr.base_sha256[:12]}), the base this delta was made from; not applied")
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
            what = f"{label}: tensor {t['name']!r}"
            positions, values, coding = _decode_tensor(dec, data, pos, t, flat, hdr.format, what)
            pos += t["frame_bytes"] if hdr.format == 1 else sum(t["frame_bytes"])
            idx, old, error = _kernels().apply_changes(flat, positions, values, coding)
            undo.append((flat, idx, old))
            if error:
                raise WeightFormatError(f"{what}: {error}")
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
    """Write a full snapshot (safetensors) of ``tensors`` to ``path``: the same tensors and version give the same
    bytes (:func:`_canonical_header`), so a publish retried after its put landed is accepted by the store's
    create-only put, not refused as another object under the version.

    Returns:
        The :func:`state_sha256` of ``tensors`` (recorded in the file's metadata).
    """
    from safetensors.torch import save_file

    sha = sha256 or state_sha256(tensors)
    save_file(dict(tensors), str(path), metadata={"version": str(version), "sha256": sha, "format": "astraflow-full-1"})
    _canonical_header(Path(path))
    return sha


def _canonical_header(path: Path) -> None:
    """Rewrite a safetensors file's JSON header in place with its keys sorted.

    safetensors writes ``__metadata__`` from a Rust hash map whose order changes from call to call (6 byte-distinct
    files in 20 saves of the same tensors, safetensors 0.8): a full snapshot retried after a failed announcement
    was refused by the store as other bytes, and the trainer held at that version for good. The sorted header has
    the same length (the same keys and values, compact, as safetensors writes it) and keeps its space padding; a
    header that would not fit is left as it is.
    """
    with path.open("r+b") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        canonical = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        if len(canonical) <= size:
            f.seek(8)
            f.write(canonical.ljust(size, b" "))


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


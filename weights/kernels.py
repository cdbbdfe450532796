"""Compiled kernels of the delta codec (numba): finding the changed elements of a tensor, coding them into
byte planes, and applying them.

**Encoding.** The delta encoder (:func:`weights.codec.encode_delta`) must read both versions of every tensor, which is
memory-bound: on this project's 2-core machine comparing two 56 MB bf16 states alone takes longer than
copying one. Done as numpy passes (compare, ``flatnonzero``, gathers, then a look inside the differing
words), the arrays are read from memory several times and the small passes add up to 3-4x the copy time.
This module does it in one compiled kernel (numba) per slice of :data:`SLICE_WORDS` words, which stays in a
core's L2 cache while the kernel compares words, looks inside the differing ones and hashes the slice:
21 ms against 31 ms for numpy's passes and the hash, on ``scripts/bench_weights.py``'s model at lr 1e-6.

**Decoding.** Applying a tensor's changes was six numpy passes over them (join the byte planes, widen,
cumulative sum, gather the base, undo the coding, scatter), two of them random accesses to the tensor;
:func:`apply_changes` does it in one loop: 12-13 ms against 17 ms of numpy passes on the same model; what is
left is mostly reading and writing the tensor's cache lines once, in order (the changes are sorted).

Coding the changes (gaps, and values raw, XOR or zigzag difference) and splitting them into byte planes is
one loop each too, where numpy took three to five passes.

Kernels are compiled once per element width and cached on disk (numba's ``cache=True``) where numba finds a
writable cache directory (:func:`_kernel`).
"""
from __future__ import annotations

import numba
import numpy as np
import xxhash

#: Value codings known to :func:`apply_changes` (:data:`weights.codec.VALUES`), by kernel code.
CODING_CODES = {"raw": 0, "xor": 1, "diff": 2}


def _kernel(**options):
    """``numba.njit`` for this module's kernels: no GIL, no bounds checks, cached on disk; compiled in each
    process instead where numba finds no writable cache directory (a read-only install with an unwritable
    home), which it reports by raising ``RuntimeError`` when a cached function is defined."""
    def decorate(function):
        try:
            return numba.njit(cache=True, nogil=True, boundscheck=False, **options)(function)
        except RuntimeError:
            return numba.njit(cache=False, nogil=True, boundscheck=False, **options)(function)
    return decorate


#: 8-byte words per slice: two slices (256 KiB each) and the kernel's scratch (128 KiB) stay in a core's L2 cache.
SLICE_WORDS = 1 << 15


@_kernel()
def _slice_changes(old, new, old_words, new_words, first, scratch, idx, old_values, new_values, count):
    """Append the changed elements of one slice to ``idx``/``old_values``/``new_values`` from ``count`` on.

    ``old``/``new`` (n,) are the slice's elements and ``old_words``/``new_words`` (n/per,) the same bytes as
    uint64; ``first`` is the flat index of the slice's first element. The differing words are first
    collected without a branch (``scratch``), then only their elements are compared. Returns the new count.
    """
    per = old.size // old_words.size
    words = 0
    for i in range(old_words.size):
        scratch[words] = i
        words += old_words[i] != new_words[i]
    for k in range(words):
        start = scratch[k] * per
        for j in range(start, start + per):
            a, b = old[j], new[j]
            idx[count] = first + j
            old_values[count] = a
            new_values[count] = b
            count += a != b
    return count


class ScanBuffers:
    """Outputs of :func:`changed_elements`: room for ``elements`` changed elements of up to 8 bytes, grown as a
    scan needs (it needs room for a whole slice beyond the changes found so far).

    Made once per delta, not per tensor, so that their pages are faulted in once (a fresh page costs the
    kernel a fault and a zeroing). Arrays returned by a scan are views into these buffers, valid until the
    next scan.
    """

    def __init__(self, elements: int):
        self.idx = np.empty(elements, np.int64)
        self.old_values = np.empty(elements, np.uint64)
        self.new_values = np.empty(elements, np.uint64)
        self.scratch = np.empty(SLICE_WORDS, np.int32)  # word offsets within a slice

    def reserve(self, elements: int, keep: int) -> None:
        """Make room for at least ``elements`` (doubling), keeping the first ``keep`` of each buffer."""
        if elements <= self.idx.size:
            return
        size = max(elements, 2 * self.idx.size)
        for name in ("idx", "old_values", "new_values"):
            grown = np.empty(size, getattr(self, name).dtype)
            grown[:keep] = getattr(self, name)[:keep]
            setattr(self, name, grown)


def changed_elements(old: np.ndarray, new: np.ndarray,
                     buffers: ScanBuffers) -> tuple[np.ndarray, np.ndarray, np.ndarray, bytes]:
    """The elements whose bits differ between two flat unsigned-integer arrays, and the digest of ``new``.

    Args:
        old, new: (n,) arrays of the same unsigned dtype (uint8/16/32/64: :func:`weights.codec.bits`).
        buffers: where the results go (:class:`ScanBuffers`, grown as needed).

    Returns:
        ``(idx, old_values, new_values, digest)``: the sorted flat indices (k,) int64 of the changed elements,
        their old and new bits (k,) in ``old``'s dtype (views into ``buffers``), and the 16-byte xxh3-128
        digest of ``new``'s bytes (equal to ``xxhash.xxh3_128_digest(new)``).
    """
    per = 8 // old.itemsize
    head = old.size // per * per
    old_words, new_words = old[:head].view(np.uint64), new[:head].view(np.uint64)
    digest = xxhash.xxh3_128()
    count = 0
    for word in range(0, old_words.size, SLICE_WORDS):
        end = min(word + SLICE_WORDS, old_words.size)
        buffers.reserve(count + (end - word) * per, keep=count)  # the kernel writes a slot for every element
        count = _slice_changes(old[word * per:end * per], new[word * per:end * per], old_words[word:end],
                               new_words[word:end], word * per, buffers.scratch, buffers.idx,
                               buffers.old_values.view(old.dtype), buffers.new_values.view(old.dtype), count)
        digest.update(new_words[word:end])  # while the slice is in cache
    digest.update(new[head:])
    buffers.reserve(count + old.size - head, keep=count)
    idx, old_values, new_values = buffers.idx, buffers.old_values.view(old.dtype), buffers.new_values.view(old.dtype)
    for j in np.flatnonzero(old[head:] != new[head:]) + head:  # fewer than 8 trailing elements
        idx[count], old_values[count], new_values[count] = j, old[j], new[j]
        count += 1
    return idx[:count], old_values[:count], new_values[:count], digest.digest()


@_kernel()
def _max_gap(idx):
    """The largest of idx[0] and the differences of consecutive elements of ``idx`` (n,) int64, n >= 1."""
    largest = idx[0]
    for i in range(1, idx.size):
        largest = max(largest, idx[i] - idx[i - 1])
    return largest


@_kernel()
def _write_gap_planes(idx, planes):
    """Write the gaps of ``idx`` (n,) into ``planes`` (width, n), byte k of every gap in row k."""
    previous = 0
    for i in range(idx.size):
        gap = idx[i] - previous
        previous = idx[i]
        for k in range(planes.shape[0]):
            planes[k, i] = (gap >> (8 * k)) & 0xFF


def gap_planes(idx: np.ndarray) -> np.ndarray:
    """The ``"gaps"`` positions of sorted flat indices, byte-plane split at the narrowest width that holds them.

    Args:
        idx: (n,) int64, strictly increasing, non-negative, n >= 1.

    Returns:
        (width, n) uint8: the first index, then the differences of consecutive indices, as unsigned integers of
        ``width`` bytes (1, 2, 4 or 8: the least that holds the largest), byte k of each in row k.
    """
    largest = int(_max_gap(idx))
    width = next(w for w in (1, 2, 4, 8) if largest < (1 << (8 * w)))
    planes = np.empty((width, idx.size), np.uint8)
    _write_gap_planes(idx, planes)
    return planes


@_kernel()
def _write_value_planes(old, new, coding, mask, planes):
    """Code each change (raw, xor or diff: :data:`CODING_CODES`) and write byte k of it into ``planes[k]``."""
    top = np.uint64(8 * planes.shape[0] - 1)
    for i in range(old.size):
        a, b = np.uint64(old[i]), np.uint64(new[i])
        if coding == 0:
            value = b
        elif coding == 1:
            value = a ^ b
        else:  # zigzag of the wrapping difference: 0, -1, 1, -2, ... -> 0, 1, 2, 3, ...
            d = (b - a) & mask
            value = ((d << np.uint64(1)) ^ (np.uint64(0) - (d >> top))) & mask
        for k in range(planes.shape[0]):
            planes[k, i] = (value >> np.uint64(8 * k)) & np.uint64(0xFF)


def value_planes(old: np.ndarray, new: np.ndarray, coding: str) -> np.ndarray:
    """A tensor's changed values in one coding, byte-plane split.

    Args:
        old, new: (n,) the changed elements' base and new bits, one unsigned dtype of width w bytes.
        coding: ``"raw"`` (the new bits), ``"xor"`` (new XOR base) or ``"diff"`` (the zigzag of new - base,
            wrapping at w bytes, so that a change of +-k units in the last place is about log2(k)+1 bits).

    Returns:
        (w, n) uint8: byte k of every coded value in row k (the inverse of what :func:`apply_changes` reads).
    """
    width = old.itemsize
    planes = np.empty((width, old.size), np.uint8)
    _write_value_planes(old, new, CODING_CODES[coding], np.uint64((1 << (8 * width)) - 1), planes)
    return planes


@_kernel(inline="always")
def _write(flat, position, value_planes, i, coding, mask, idx, old):
    """Decode change ``i`` of ``value_planes`` against the bits at ``flat[position]``, write it, log the undo."""
    value = np.uint64(0)
    for k in range(value_planes.shape[0]):
        value |= np.uint64(value_planes[k, i]) << np.uint64(8 * k)
    base = flat[position]
    if coding == 1:
        value ^= np.uint64(base)
    elif coding == 2:  # zigzag back to a wrapping difference, then add it to the base
        value = ((value >> np.uint64(1)) ^ (np.uint64(0) - (value & np.uint64(1)))) + np.uint64(base)
    idx[i] = position
    old[i] = base
    flat[position] = value & mask


@_kernel()
def _apply_gaps(flat, gap_planes, value_planes, coding, mask, idx, old):
    """Apply changes at gap-coded positions; returns how many were applied: all, or those before the first
    position out of range or not above the previous one (so that no position is written twice and the undo log
    holds every element's original bits)."""
    n = idx.size
    position = np.uint64(0)
    for i in range(n):
        gap = np.uint64(0)
        for k in range(gap_planes.shape[0]):
            gap |= np.uint64(gap_planes[k, i]) << np.uint64(8 * k)
        if i == 0:
            position = gap
        elif gap == 0 or position + gap < position:  # a repeated position, or one past 2^64 (malformed objects)
            return i
        else:
            position += gap
        if position >= flat.size:
            return i
        _write(flat, position, value_planes, i, coding, mask, idx, old)
    return n


@_kernel()
def _apply_bitmap(flat, bitmap, value_planes, coding, mask, idx, old):
    """Apply changes at the positions a bitmap marks (little bit order). Returns ``(applied, marks)``: changes
    are applied in order until ``idx.size`` are, or until a mark falls outside ``flat``; every mark is counted."""
    n, applied, marks = idx.size, 0, 0
    for byte in range(bitmap.size):
        bits = bitmap[byte]
        if bits == 0:
            continue
        for bit in range(8):
            if (bits >> bit) & 1:
                position = byte * 8 + bit
                marks += 1
                if applied == marks - 1 and applied < n and position < flat.size:
                    _write(flat, position, value_planes, applied, coding, mask, idx, old)
                    applied += 1
    return applied, marks


def apply_changes(flat: np.ndarray, positions: np.ndarray, value_planes: np.ndarray,
                  coding: str) -> tuple[np.ndarray, np.ndarray, str | None]:
    """Write a tensor's decoded changes into its flat bits, keeping what they overwrote.

    Args:
        flat: (size,) the tensor's bits (uint8/16/32/64, :func:`weights.codec.bits`), modified in place.
        positions: where the changes go, as :mod:`weights.codec` codes them: ``"gaps"``, the byte planes
            (index_bytes, n) uint8 of the first flat index then the differences of consecutive indices; or
            ``"bitmap"``, (ceil(size / 8),) uint8, one bit per element in little bit order.
        value_planes: (flat.itemsize, n) uint8, the byte planes of the coded values.
        coding: ``"raw"`` (the new bits), ``"xor"`` (new XOR base) or ``"diff"`` (zigzag of new - base,
            wrapping at the element width).

    Returns:
        ``(idx, old, error)``: the flat indices (m,) int64 written and their previous bits (m,) in ``flat``'s
        dtype (the undo log), and ``None`` when all ``n`` changes were applied, else what is wrong with the
        positions (an index out of range, or a bitmap with another number of marks than ``n``); then only
        the first ``m`` were applied, and the caller restores ``flat[idx] = old``.
    """
    n = value_planes.shape[1]
    idx, old = np.empty(n, np.int64), np.empty(n, flat.dtype)
    mask = np.uint64((1 << (8 * flat.itemsize)) - 1)
    if positions.ndim == 2:
        applied = _apply_gaps(flat, positions, value_planes, CODING_CODES[coding], mask, idx, old)
        error = None if applied == n else f"index out of range or not increasing ({flat.size} elements)"
    else:
        applied, marks = _apply_bitmap(flat, positions, value_planes, CODING_CODES[coding], mask, idx, old)
        error = None if applied == marks == n else (
            f"bitmap marks {marks} elements, header says {n}" if marks != n else
            f"bitmap marks an element past the end ({flat.size} elements)")
    return idx[:applied], old[:applied], error

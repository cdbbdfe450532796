"""The compiled kernels of the delta codec: the change scan finds exactly the elements numpy finds, across slices
and ragged tails, for every element width, and hashes as xxh3-128 does in one call; gaps and values are coded and
byte-plane split as numpy does it; applying changes writes every value coding bit-exactly at gap or bitmap positions,
keeps the undo log, and stops at positions that do not fit."""
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
import xxhash

from weights.kernels import (SLICE_WORDS, ScanBuffers, _kernel, apply_changes, changed_elements, gap_planes,
                             value_planes)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.03, 0.5, 1.0])
def test_changed_elements_match_numpy_across_slices_and_tails(dtype, density):
    rng = np.random.default_rng(7)
    per = 8 // np.dtype(dtype).itemsize
    n = 2 * SLICE_WORDS * per + 3 * per + per - 1  # two full slices, a short one, and a ragged tail
    old = rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype, endpoint=True)
    new = old.copy()
    hit = rng.random(n) < density
    hit[[0, n - 1, SLICE_WORDS * per - 1, SLICE_WORDS * per]] = density > 0  # both ends and a slice boundary
    new[hit] ^= rng.integers(1, np.iinfo(dtype).max, int(hit.sum()), dtype=dtype, endpoint=True)  # nonzero flip
    buffers = ScanBuffers(SLICE_WORDS // 2)  # grown by the scan
    idx, old_values, new_values, digest = changed_elements(old, new, buffers)
    expect = np.flatnonzero(hit)
    assert idx.dtype == np.int64 and old_values.dtype == dtype and new_values.dtype == dtype
    np.testing.assert_array_equal(idx, expect)
    np.testing.assert_array_equal(old_values, old[expect])
    np.testing.assert_array_equal(new_values, new[expect])
    assert digest == xxhash.xxh3_128_digest(new)


def test_short_and_empty_arrays():
    buffers = ScanBuffers(8)
    for old, new in [(np.array([], np.uint16), np.array([], np.uint16)),
                     (np.array([1, 2, 3], np.uint16), np.array([1, 5, 3], np.uint16))]:
        idx, old_values, new_values, digest = changed_elements(old, new, buffers)
        np.testing.assert_array_equal(idx, np.flatnonzero(old != new))
        np.testing.assert_array_equal(new_values, new[old != new])
        assert digest == xxhash.xxh3_128_digest(new)


def split_planes(a: np.ndarray) -> np.ndarray:
    """(n,) unsigned -> (itemsize, n) uint8 byte planes, low byte first."""
    return np.ascontiguousarray(a.view(np.uint8).reshape(-1, a.itemsize).T)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize("coding", ["raw", "xor", "diff"])
def test_every_coding_is_written_as_numpy_codes_it_and_applied_bit_exactly_with_an_undo_log(dtype, coding):
    rng = np.random.default_rng(3)
    base = rng.integers(0, np.iinfo(dtype).max, 1000, dtype=dtype, endpoint=True)
    base[:4] = [0, np.iinfo(dtype).max, 1, np.iinfo(dtype).max - 1]  # differences that wrap both ways
    target = rng.integers(0, np.iinfo(dtype).max, 1000, dtype=dtype, endpoint=True)
    target[:4] = [np.iinfo(dtype).max, 0, np.iinfo(dtype).max, 0]
    idx = np.sort(rng.choice(1000, 300, replace=False))
    idx[:4] = [0, 1, 2, 3]
    idx.sort()
    new = target[idx]
    diff = new - base[idx]  # wrapping
    zigzag = (diff << dtype(1)) ^ (-(diff >> dtype(8 * base.itemsize - 1))).astype(dtype)
    coded = {"raw": new, "xor": new ^ base[idx], "diff": zigzag}[coding]
    np.testing.assert_array_equal(value_planes(base[idx], new, coding), split_planes(coded))
    gaps = np.diff(idx, prepend=0).astype(np.uint16)
    flat = base.copy()
    got_idx, old, error = apply_changes(flat, split_planes(gaps), split_planes(coded), coding)
    assert error is None
    np.testing.assert_array_equal(flat[idx], new)
    np.testing.assert_array_equal(np.delete(flat, idx), np.delete(base, idx))
    np.testing.assert_array_equal(got_idx, idx)
    np.testing.assert_array_equal(old, base[idx])


def test_apply_changes_stops_at_an_index_out_of_range():
    flat = np.arange(10, dtype=np.uint16)
    gaps = np.array([2, 3, 9, 1], np.uint8)  # indices 2, 5, 14 (out of range), 15
    values = np.array([100, 101, 102, 103], np.uint16)
    idx, old, error = apply_changes(flat, split_planes(gaps), split_planes(values), "raw")
    assert error == "index out of range or not increasing (10 elements)"
    np.testing.assert_array_equal(idx, [2, 5])
    np.testing.assert_array_equal(old, [2, 5])
    assert flat[2] == 100 and flat[5] == 101


def test_apply_changes_at_bitmap_positions_and_a_bitmap_that_does_not_fit():
    flat = np.arange(20, dtype=np.uint32)
    marks = np.zeros(24, bool)
    marks[[1, 8, 9, 19]] = True
    bitmap = np.packbits(marks, bitorder="little")
    values = np.array([100, 101, 102, 103], np.uint32)
    idx, old, error = apply_changes(flat, bitmap, split_planes(values), "raw")
    assert error is None
    np.testing.assert_array_equal(idx, [1, 8, 9, 19])
    np.testing.assert_array_equal(old, [1, 8, 9, 19])
    np.testing.assert_array_equal(flat[[1, 8, 9, 19]], values)
    marks[21] = True  # a mark in the last byte's padding, past the tensor's end
    flat = np.arange(20, dtype=np.uint32)
    idx, old, error = apply_changes(flat, np.packbits(marks, bitorder="little"), split_planes(np.append(values, 104)),
                                    "raw")
    assert error == "bitmap marks an element past the end (20 elements)"
    np.testing.assert_array_equal(idx, [1, 8, 9, 19])  # applied before it: the caller restores them
    flat = np.arange(20, dtype=np.uint32)
    _, _, error = apply_changes(flat, np.packbits(marks, bitorder="little"), split_planes(values), "raw")
    assert error == "bitmap marks 5 elements, header says 4"


@pytest.mark.parametrize("largest, width", [(255, 1), (256, 2), (65535, 2), (65536, 4), (1 << 32, 8)])
def test_gap_planes_take_the_narrowest_width(largest, width):
    idx = np.array([3, 4, 4 + largest, 10 + largest], np.int64)
    planes = gap_planes(idx)
    assert planes.shape == (width, 4) and planes.dtype == np.uint8
    gaps = (planes.astype(np.uint64) << (8 * np.arange(width, dtype=np.uint64))[:, None]).sum(axis=0)
    np.testing.assert_array_equal(gaps, [3, 1, largest, 6])


@pytest.mark.parametrize("gaps, width", [([5, 0], 1), ([5, 2**64 - 1, 1], 8)])
def test_apply_changes_stops_at_a_repeated_position_so_the_undo_log_is_exact(gaps, width):
    """A gap of 0, or 8-byte gaps that wrap past 2^64 onto an earlier index, would write an element twice and log
    its first new value as its original: refused at the repeat."""
    flat = np.zeros(16, np.uint16)
    planes = split_planes(np.array(gaps, dtype=f"uint{8 * width}"))
    idx, old, error = apply_changes(flat, planes, split_planes(np.arange(1, len(gaps) + 1, dtype=np.uint16)), "raw")
    assert error == "index out of range or not increasing (16 elements)"
    np.testing.assert_array_equal(idx, [5])
    flat[idx] = old
    assert not flat.any()


def test_a_kernel_numba_cannot_cache_is_compiled_per_process():
    """Functions numba finds no cache directory for (here: defined in code without a file) still compile."""
    namespace = {}
    exec("def twice(x):\n    return 2 * x\n", namespace)
    with pytest.raises(RuntimeError, match="cannot cache"):
        numba.njit(cache=True)(namespace["twice"])
    assert _kernel()(namespace["twice"])(21) == 42


def test_warm_kernels_leaves_the_first_delta_nothing_to_import():
    """The publisher's thread calls warm_kernels as it starts: afterwards a fresh interpreter's first delta of
    float32 and bfloat16 tensors, encoded and applied, imports no module (numba and the kernels are loaded)."""
    script = """
import sys
import torch
from weights.codec import apply_delta, encode_delta, warm_kernels
assert "numba" not in sys.modules
warm_kernels()
before = set(sys.modules)
old = {"a": torch.zeros(5000), "b": torch.zeros(3000, dtype=torch.bfloat16)}
new = {k: v.clone() for k, v in old.items()}
new["a"][::3] = 1.5
new["b"][::5] = -2.0
delta = encode_delta(old, new, base_version=1, version=2)
apply_delta(delta.data, old)
assert all(torch.equal(old[k], new[k]) for k in old)
print(sorted(set(sys.modules) - before))
"""
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"

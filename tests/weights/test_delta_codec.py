"""The delta codec round-trips bit-exactly through every coding, reads the previous format, and rejects corrupt
objects and wrong bases without touching the weights."""
import re
import shutil
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topics.names import TopicNames
from weights import codec
from weights.codec import (POSITIONS, VALUES, BaseMismatch, ChecksumMismatch, WeightFormatError, apply_delta, bits,
                           encode_delta, load_full, read_header, save_full, state_sha256)
from weights.puller import Puller
from weights.store import WeightStore

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
CODINGS = [(p, v) for p in POSITIONS for v in VALUES]
#: A store written by the format-1 codec (2026-12-03): policy "policy", a full snapshot at version 1, deltas at 2 and 3.
FORMAT1_STORE = Path(__file__).parent / "data" / "store_format1"
FORMAT1_SHA256 = {2: "ea5f3405263b0ab9b769f133671c8043c983bfd4ea95c08afda18ed46a7c0621",
                  3: "e1630c7d790a293c919bc79aa10e8bc2a03e43e3d81d8e190bcacdbae3e088aa"}


def random_bits(shape, dtype, rng) -> torch.Tensor:
    """A tensor of ``shape``/``dtype`` with uniformly random bit patterns (NaNs, infs, -0.0 included)."""
    width = torch.empty((), dtype=dtype).element_size()
    raw = rng.integers(0, 1 << (8 * width), size=int(np.prod(shape)), dtype=np.uint64).astype(f"uint{8 * width}")
    t = torch.empty(shape, dtype=dtype)
    bits(t)[:] = raw
    return t


def special_values(dtype) -> np.ndarray:
    """Bit patterns of NaNs (quiet, signalling, negative), +-0, +-inf, the smallest and largest denormals of ``dtype``."""
    width = torch.empty((), dtype=dtype).element_size() * 8
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    sign, exp_all = 1 << (width - 1), ((1 << (width - 1 - mant)) - 1) << mant
    pats = [0, sign, exp_all, sign | exp_all, exp_all | 1, exp_all | (1 << (mant - 1)), sign | exp_all | 3,
            1, sign | 1, (1 << mant) - 1, sign | ((1 << mant) - 1)]
    return np.array(pats, dtype=f"uint{width}")


def clone(state):
    return {k: v.clone() for k, v in state.items()}


def assert_bit_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(bits(a[k]), bits(b[k])), k


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=3), min_size=1, max_size=4),
    dtype=st.sampled_from(DTYPES),
    fraction=st.one_of(st.just(0.0), st.just(1.0), st.floats(0.0, 1.0)),
    coding=st.sampled_from([None, *CODINGS]),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_bit_exact(shapes, dtype, fraction, coding, seed):
    """Random tensors seeded with NaNs, signed zeros, denormals and infinities; changes are small steps in
    the last place (as training makes them), random bit patterns, and special values, in both directions."""
    rng = np.random.default_rng(seed)
    specials = special_values(dtype)
    old = {f"t{i}": random_bits(tuple(s), dtype, rng) for i, s in enumerate(shapes)}
    for t in old.values():
        flat = bits(t)
        seeded = rng.random(flat.size) < 0.2
        flat[seeded] = rng.choice(specials, size=int(seeded.sum()))
    new = clone(old)
    for t in new.values():
        flat = bits(t)
        mask = rng.random(flat.size) < fraction
        kind = rng.integers(0, 3, size=flat.size)
        steps = rng.integers(-3, 4, size=flat.size).astype(np.int64)
        steps[steps == 0] = 1
        stepped = (flat.astype(np.int64) + steps).astype(flat.dtype)  # wraps at the width, like the codec
        randomised = bits(random_bits((flat.size,), dtype, rng))
        special = rng.choice(specials, size=flat.size)
        flat[mask] = np.choose(kind, [stepped, randomised, special])[mask]
    delta = encode_delta(old, new, base_version=3, version=7, level=1, coding=coding)
    expected_changed = sum(int(np.count_nonzero(bits(old[k]) != bits(new[k]))) for k in old)
    assert delta.changed == expected_changed
    assert delta.sha256 == state_sha256(new)
    hdr = read_header(delta.data)
    assert hdr.format == 2 and hdr.base_sha256 == state_sha256(old)
    if coding is not None:
        assert {(t["positions"], t["values"]) for t in hdr.tensors if t["count"]} <= {coding}
    got = clone(old)
    hdr = apply_delta(delta.data, got, expect_sha256=state_sha256(new), base_sha256=state_sha256(old))
    assert (hdr.base_version, hdr.version) == (3, 7)
    assert_bit_equal(got, new)


def test_small_steps_pick_base_relative_values_and_dense_tensors_a_bitmap():
    """Measured choice: +-1 ulp steps cost less as differences than as raw bits, and a tensor where most
    elements changed codes its positions as a bitmap; the chosen delta is never larger than gaps + raw."""
    rng = np.random.default_rng(5)
    old = {"sparse": torch.randn(20000, dtype=torch.float32).to(torch.bfloat16),
           "dense": torch.randn(4000, dtype=torch.float32).to(torch.bfloat16)}
    new = clone(old)
    for name, fraction in (("sparse", 0.03), ("dense", 0.6)):
        flat = bits(new[name])
        mask = rng.random(flat.size) < fraction
        flat[mask] += rng.choice(np.array([1, 0xFFFF], np.uint16), size=int(mask.sum()))  # +-1 in the last place
    chosen = encode_delta(old, new, base_version=0, version=1)
    codings = {t["name"]: (t["positions"], t["values"]) for t in read_header(chosen.data).tensors}
    assert codings == {"sparse": ("gaps", "diff"), "dense": ("bitmap", "diff")}
    for coding in CODINGS:
        assert len(chosen.data) <= len(encode_delta(old, new, base_version=0, version=1, coding=coding).data)


def test_deltas_of_real_optimizer_steps_chain_bit_exact():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 32), torch.nn.Linear(32, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 50)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    snap = lambda: {k: v.detach().clone() for k, v in model.state_dict().items()}  # noqa: E731
    versions = [snap()]
    for _ in range(4):
        x = torch.randint(0, 50, (8, 12))
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        versions.append(snap())
    local = clone(versions[0])
    for v in range(1, len(versions)):
        d = encode_delta(versions[v - 1], versions[v], base_version=v - 1, version=v,
                         base_sha256=state_sha256(versions[v - 1]))
        assert 0.0 < d.sparsity < 1.0
        apply_delta(d.data, local, base_sha256=state_sha256(local))
        assert_bit_equal(local, versions[v])


@pytest.fixture
def pair():
    rng = np.random.default_rng(1)
    old = {"a": random_bits((64, 16), torch.bfloat16, rng), "b": random_bits((100,), torch.float32, rng)}
    new = clone(old)
    bits(new["a"])[::7] ^= 1
    bits(new["b"])[3] ^= 1 << 20
    return old, new, encode_delta(old, new, base_version=0, version=1)


@pytest.mark.parametrize("damage", ["flip_frame_byte", "truncate", "bad_magic", "garbage_header"])
def test_corrupt_delta_is_rejected_and_weights_untouched(pair, damage):
    old, new, d = pair
    data = bytearray(d.data)
    if damage == "flip_frame_byte":
        data[-20] ^= 0x40
    elif damage == "truncate":
        data = data[:-5]
    elif damage == "bad_magic":
        data[0:4] = b"XXXX"
    else:
        data[40:60] = b"\xc1" * 20
    local = clone(old)
    with pytest.raises(WeightFormatError):
        apply_delta(bytes(data), local)
    assert_bit_equal(local, old)


@pytest.mark.parametrize("coding", CODINGS)
def test_every_flipped_bit_is_detected(coding):
    """One bit flipped in any byte of the object (prefix, header, check, any frame) is refused, weights untouched."""
    rng = np.random.default_rng(2)
    old = {"a": random_bits((40, 8), torch.bfloat16, rng), "b": random_bits((50,), torch.float32, rng),
           "c": random_bits((30,), torch.float16, rng)}
    new = clone(old)
    for t in new.values():
        bits(t)[::3] += 1
    data = encode_delta(old, new, base_version=4, version=5, coding=coding).data
    for i in range(len(data)):
        damaged = bytearray(data)
        damaged[i] ^= 1 << (i % 8)
        local = clone(old)
        with pytest.raises(WeightFormatError):
            apply_delta(bytes(damaged), local)
        assert_bit_equal(local, old)


def repack(hdr, frames: list[bytes], **last) -> bytes:
    """A format-2 object from a header's fields and per-tensor frames, with a valid xxh3 check (a well-formed object
    whose content may be wrong); ``last`` overrides fields of the last tensor's entry."""
    tensors = [dict(t) for t in hdr.tensors]
    it = iter(frames)
    for t in tensors:
        if t["count"]:
            t["frame_bytes"] = [len(next(it)), len(next(it))]
    tensors[-1].update(last)
    header = msgpack.packb({"sha256": hdr.sha256, "base_sha256": hdr.base_sha256, "tensors": tensors},
                           use_bin_type=True)
    body = codec._PREFIX.pack(codec.MAGIC, codec.FORMAT, 0, hdr.base_version, hdr.version, len(header)) + header
    check = xxhash.xxh3_64(body)
    for f in frames:
        check.update(f)
    return body + codec._CHECK.pack(check.intdigest()) + b"".join(frames)


@pytest.mark.parametrize("positions", ["gaps", "bitmap"])
def test_well_formed_positions_past_a_tensor_are_refused_and_earlier_tensors_restored(pair, positions):
    """Positions past the end of the last tensor, in an object whose check holds: refused with the tensor named, and
    the tensors applied before it restored bit-exactly."""
    old, new, _ = pair
    d = encode_delta(old, new, base_version=0, version=1, coding=(positions, "raw"))
    hdr = read_header(d.data)
    frames = frames_of(d.data)
    b = hdr.tensors[-1]  # "b": 100 float32, one change at index 3
    assert b["name"] == "b" and b["count"] == 1
    if positions == "gaps":
        frames[-2] = zstandard.ZstdCompressor().compress(bytes([103]))  # index 103 of 100
        expect = "index out of range or not increasing (100 elements)"
    else:
        bitmap = np.zeros(104, bool)
        bitmap[[3, 101]] = True  # a second mark in the last byte's padding
        frames[-2] = zstandard.ZstdCompressor().compress(np.packbits(bitmap, bitorder="little").tobytes())
        expect = "bitmap marks 2 elements, header says 1"
    local = clone(old)
    with pytest.raises(WeightFormatError, match=re.escape(f"delta 0->1: tensor 'b': {expect}")):
        apply_delta(repack(hdr, frames), local)
    assert_bit_equal(local, old)


def frames_of(data: bytes) -> list[bytes]:
    hdr = read_header(data)
    frames, pos = [], hdr.frames_offset
    for t in hdr.tensors:
        for n in t["frame_bytes"]:
            frames.append(data[pos:pos + n])
            pos += n
    return frames


@pytest.mark.parametrize("entry, expect", [
    (dict(count=2), "index out of range or not increasing"),  # with gaps [3, 0]: index 3 twice
    (dict(count=101), "101 changes in a tensor of 100 elements"),
    (dict(count=1.0), "bad entry"), (dict(count=True), "bad entry"), (dict(index_bytes=True), "bad index_bytes"),
    (dict(frame_bytes=[1.0, 2]), "bad frame_bytes")])
def test_well_formed_entries_that_do_not_fit_are_refused_and_weights_untouched(pair, entry, expect):
    old, new, _ = pair
    d = encode_delta(old, new, base_version=0, version=1, coding=("gaps", "raw"))
    frames = frames_of(d.data)
    if entry == dict(count=2):  # tensor "b": 100 float32
        frames[-2:] = [zstandard.ZstdCompressor().compress(bytes([3, 0])), zstandard.ZstdCompressor().compress(bytes(8))]
    local = clone(old)
    with pytest.raises(WeightFormatError, match=re.escape(expect)):
        apply_delta(repack(read_header(d.data), frames, **entry), local)
    assert_bit_equal(local, old)


def test_wrong_base_is_refused_naming_the_versions(pair):
    old, new, d = pair
    assert read_header(d.data).base_relative
    other = clone(old)
    bits(other["a"])[5] ^= 2  # a base the delta was not made from
    before = clone(other)
    with pytest.raises(BaseMismatch, match=r"delta 0->1: the local weights \(sha256 \w+\) are not version 0 .*not applied"):
        apply_delta(d.data, other, base_sha256=state_sha256(other))
    assert_bit_equal(other, before)


def test_wrong_base_is_rolled_back(pair):
    old, new, d = pair
    other = clone(old)
    bits(other["a"])[5] ^= 2  # a base the delta was not made from
    before = clone(other)
    with pytest.raises(ChecksumMismatch, match="restored"):
        apply_delta(d.data, other)
    assert_bit_equal(other, before)


def test_delta_does_not_fit_local_tensors(pair):
    old, new, d = pair
    with pytest.raises(WeightFormatError, match="names differ"):
        apply_delta(d.data, {"a": old["a"].clone()})
    with pytest.raises(WeightFormatError, match="tensor 'b'"):
        apply_delta(d.data, {"a": old["a"].clone(), "b": torch.zeros(100, dtype=torch.float16)})


def test_max_bytes_gives_up_on_dense_delta(pair):
    old, new, d = pair
    assert encode_delta(old, new, base_version=0, version=1, max_bytes=10) is None
    assert read_header(d.data).tensors[0]["count"] == len(range(0, 64 * 16, 7))


def test_a_full_snapshot_of_the_same_tensors_has_the_same_bytes(tmp_path, pair):
    """A publish retried after its put landed must find the same bytes there (the store's create-only put accepts
    only those): safetensors alone wrote its metadata in a varying order (6 distinct files in 20 saves), and a
    trainer whose announcement failed in a broker outage was refused its own version for good."""
    _, new, _ = pair
    files = set()
    for i in range(20):
        save_full(new, tmp_path / f"{i}.safetensors", version=9)
        files.add((tmp_path / f"{i}.safetensors").read_bytes())
    assert len(files) == 1
    loaded, version, sha = load_full(tmp_path / "0.safetensors")
    assert version == 9 and sha == state_sha256(new)
    assert_bit_equal(dict(loaded), new)


def test_full_snapshot_round_trip_and_corruption(tmp_path, pair):
    old, new, _ = pair
    path = tmp_path / "full.safetensors"
    sha = save_full(new, path, version=9)
    loaded, version, got_sha = load_full(path)
    assert (version, got_sha) == (9, sha)
    assert_bit_equal(dict(loaded), new)
    into = clone(old)
    load_full(path, into, expect_sha256=sha)
    assert_bit_equal(into, new)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    into = clone(old)
    with pytest.raises(ChecksumMismatch, match="not loaded"):
        load_full(path, into)
    assert_bit_equal(into, old)


def test_store_written_by_format1_is_read(tmp_path):
    """A store written by the format-1 codec: a fresh puller takes the full snapshot and both deltas."""
    for v in (2, 3):
        assert read_header((FORMAT1_STORE / "run" / "policy" / f"{v:08d}" / "delta.zst").read_bytes()).format == 1
    shutil.copytree(FORMAT1_STORE, tmp_path / "store")
    puller = Puller(WeightStore(f"file://{tmp_path / 'store'}", "run"), None, TopicNames("run"), "policy")
    assert [(s.version, s.kind) for s in puller.plan(3)] == [(1, "full"), (2, "delta"), (3, "delta")]
    assert puller.sync(3, expect_sha256=FORMAT1_SHA256[3])
    assert (puller.version, state_sha256(puller.state)) == (3, FORMAT1_SHA256[3])


def test_puller_falls_back_when_its_weights_are_not_the_deltas_base(tmp_path, caplog):
    """Local weights that claim version 2 but are not the deltas' version 2: the delta is refused before it is
    applied (its base checksum names the versions), excluded without a refetch, and a full snapshot is taken."""
    shutil.copytree(FORMAT1_STORE, tmp_path / "store")
    store = WeightStore(f"file://{tmp_path / 'store'}", "run")
    right = Puller(store, None, TopicNames("run"), "policy")
    right.sync(2)
    wrong = clone(right.state)
    right.sync(3)
    save_full(right.state, tmp_path / "store" / store.key("policy", 3, "full"), version=3)
    bits(wrong["0.weight"])[7] ^= 1
    puller = Puller(store, None, TopicNames("run"), "policy", state=wrong, version=2)
    assert [s.kind for s in puller.plan(3)] == ["delta"]  # the cheaper path
    assert puller.sync(3)
    assert (puller.version, state_sha256(puller.state)) == (3, FORMAT1_SHA256[3])
    refused = [r.getMessage() for r in caplog.records if "not version 2" in r.getMessage()]
    assert len(refused) == 1 and "delta 2->3" in refused[0] and "falling back" in refused[0]

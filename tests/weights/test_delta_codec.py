"""The delta codec round-trips bit-exactly, and rejects corrupt objects without touching the weights."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weights.codec import (ChecksumMismatch, WeightFormatError, apply_delta, bits, encode_delta, load_full,
                           read_header, save_full, state_sha256)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def random_bits(shape, dtype, rng) -> torch.Tensor:
    """A tensor of ``shape``/``dtype`` with uniformly random bit patterns (NaNs, infs, -0.0 included)."""
    width = torch.empty((), dtype=dtype).element_size()
    raw = rng.integers(0, 1 << (8 * width), size=int(np.prod(shape)), dtype=np.uint64).astype(f"uint{8 * width}")
    t = torch.empty(shape, dtype=dtype)
    bits(t)[:] = raw
    return t


def clone(state):
    return {k: v.clone() for k, v in state.items()}


def assert_bit_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(bits(a[k]), bits(b[k])), k


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=3), min_size=1, max_size=4),
    dtype=st.sampled_from(DTYPES),
    fraction=st.one_of(st.just(0.0), st.just(1.0), st.floats(0.0, 1.0)),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_bit_exact(shapes, dtype, fraction, seed):
    rng = np.random.default_rng(seed)
    old = {f"t{i}": random_bits(tuple(s), dtype, rng) for i, s in enumerate(shapes)}
    new = clone(old)
    for t in new.values():
        flat = bits(t)
        mask = rng.random(flat.size) < fraction
        flat[mask] = bits(random_bits((int(mask.sum()),), dtype, rng))
    delta = encode_delta(old, new, base_version=3, version=7, level=1)
    expected_changed = sum(int(np.count_nonzero(bits(old[k]) != bits(new[k]))) for k in old)
    assert delta.changed == expected_changed
    assert delta.sha256 == state_sha256(new)
    got = clone(old)
    hdr = apply_delta(delta.data, got, expect_sha256=state_sha256(new))
    assert (hdr.base_version, hdr.version) == (3, 7)
    assert_bit_equal(got, new)


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

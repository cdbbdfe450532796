"""The message codec: round trips, wire format and typed errors."""
from concurrent.futures import ThreadPoolExecutor

import msgpack
import numpy as np
import pytest
import zstandard

from topics.codec import MessageError, decode, encode, headers_for
from topics.schemas import (Control, DeadLetter, Metric, Prompt, RolloutOutcome, Sample, TrajectoryGroup,
                            WeightAnnouncement)


def make_group(rewards=(1.0, 0.0), length=6) -> TrajectoryGroup:
    samples = [
        Sample(input_ids=np.arange(length, dtype=np.int32) + i, loss_mask=[0, 0, 1, 1, 1, 1][:length],
               behavior_logprobs=np.linspace(-1, 0, length, dtype=np.float32),
               versions=[-1, -1, 3, 3, 4, 4][:length], reward=r, finish_reason="stop")
        for i, r in enumerate(rewards)
    ]
    return TrajectoryGroup.build(samples=samples, prompt_id="p1", group_id="g1", policy="actor",
                                 source="arith", task_type="arith", producer_id="raas-0")


def test_trajectory_group_round_trip_is_exact():
    g = make_group()
    assert (g.reward_mean, g.reward_std, g.zero_adv, g.min_version, g.max_version) == (0.5, 0.5, False, 3, 4)
    back = decode(encode(g), TrajectoryGroup)
    assert back.group_id == "g1" and len(back.samples) == 2
    for a, b in zip(g.samples, back.samples):
        assert a.input_ids.dtype == b.input_ids.dtype == np.int32
        assert b.behavior_logprobs.dtype == np.float32 and b.loss_mask.dtype == np.uint8
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
        np.testing.assert_array_equal(a.behavior_logprobs, b.behavior_logprobs)
        np.testing.assert_array_equal(a.versions, b.versions)
        assert a.reward == b.reward


def test_arrays_travel_as_little_endian_buffers_with_schema_and_version():
    env = msgpack.unpackb(zstandard.ZstdDecompressor().decompress(encode(make_group())), raw=False)
    assert env["schema"] == "TrajectoryGroup" and env["v"] == 1
    ids = env["body"]["samples"][0]["input_ids"]
    assert isinstance(ids, bytes) and ids == np.arange(6, dtype="<i4").tobytes()


@pytest.mark.parametrize("msg", [
    Prompt(prompt_id="a", source="gsm8k", task_type="math", text="1+1?", answer="2"),
    RolloutOutcome(prompt_id="a", group_id="g", policy="actor", rewards=[1.0, 0.0], zero_adv=False, version=2),
    WeightAnnouncement(policy="actor", version=3, base_version=2, kind="delta", uri="file:///x", bytes=10,
                       sha256="0" * 64, sparsity=0.99),
    Control(component="raas-0", action="pause"),
    Metric(component="trainer.actor", values={"loss": 0.5}, step=1),
    DeadLetter(topic="t", partition=0, offset=5, value=b"\x00", error="bad"),
])
def test_every_schema_round_trips(msg):
    assert decode(encode(msg)) == msg


def test_garbage_names_topic_partition_offset_and_reason():
    with pytest.raises(MessageError) as e:
        decode(b"not zstd at all", TrajectoryGroup, topic="run.trajectories.actor", partition=2, offset=17)
    assert (e.value.topic, e.value.partition, e.value.offset) == ("run.trajectories.actor", 2, 17)
    assert "zstd" in e.value.reason and "run.trajectories.actor[2]@17" in str(e.value)


def test_wrong_schema_and_newer_version_raise_the_same_typed_error():
    with pytest.raises(MessageError, match="schema Prompt where TrajectoryGroup was expected"):
        decode(encode(Prompt(prompt_id="a", source="s", task_type="math", text="x")), TrajectoryGroup)
    newer = zstandard.ZstdCompressor().compress(msgpack.packb({"schema": "Control", "v": 99, "body": {}}))
    with pytest.raises(MessageError, match="version 99 is newer"):
        decode(newer)
    not_msgpack = zstandard.ZstdCompressor().compress(b"\xc1\xc1\xc1")
    with pytest.raises(MessageError, match="not msgpack"):
        decode(not_msgpack)


def test_validation_on_build_and_on_decode():
    with pytest.raises(ValueError, match="loss_mask has length 2, input_ids has 3"):
        Sample(input_ids=[1, 2, 3], loss_mask=[1, 1], behavior_logprobs=[0, 0, 0], versions=[0, 0, 0], reward=1)
    with pytest.raises(ValueError, match="needs `messages` or `text`"):
        Prompt(prompt_id="a", source="s", task_type="math")
    body = make_group().model_dump()
    body["samples"][0]["loss_mask"] = b"\x01"  # wrong length on the wire
    raw = zstandard.ZstdCompressor().compress(msgpack.packb({"schema": "TrajectoryGroup", "v": 1, "body": body}))
    with pytest.raises(MessageError, match="invalid TrajectoryGroup.*loss_mask has length 1"):
        decode(raw, TrajectoryGroup, topic="t", partition=0, offset=1)


def test_routing_headers_repeat_metadata():
    h = headers_for(make_group(rewards=(1.0, 1.0)))
    assert h["policy"] == "actor" and h["model_version_min"] == "3" and h["model_version_max"] == "4"
    assert h["zero_adv"] == "1" and h["producer_id"] == "raas-0" and h["task_type"] == "arith"
    assert h["schema"] == "TrajectoryGroup" and int(h["ts_ms"]) > 1_600_000_000_000


def test_threads_encode_and_decode_at_once():
    """A trainer encodes metrics while its publisher thread encodes announcements: zstd objects are per thread."""
    def worker(k):
        for i in range(3000):
            msg = Metric(component=f"c{k}", kind="trainer", step=i, values={"loss": float(i), "k": float(k)})
            assert decode(encode(msg), Metric).values == {"loss": float(i), "k": float(k)}

    with ThreadPoolExecutor(4) as pool:
        for fut in [pool.submit(worker, k) for k in range(4)]:
            fut.result()

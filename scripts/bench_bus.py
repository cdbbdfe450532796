#!/usr/bin/env python
"""Bus throughput: realistic TrajectoryGroups through our codec and bus vs raw confluent-kafka.

Each group holds G=8 samples of 2,048 tokens (int32 ids, uint8 loss mask,
float32 behaviour logprobs, int32 versions). "Ours" encodes each group with
:mod:`topics.codec`, produces it with routing headers through
:class:`topics.kafka.KafkaProducer`, then consumes with a consumer group,
decodes and validates every group, and commits after each batch. The baseline
pushes the same pre-encoded bytes through a raw confluent-kafka producer and
consumer (same batch commits, no decode). The embedded ``local://`` backend is
measured the same way as ours. The three run in ``--repeats`` interleaved rounds
(ours, raw, local; then local, raw, ours; ...), and every run is printed.

    python scripts/bench_bus.py [--quick] [--kafka 127.0.0.1:9092] [--repeats 3]

Ends with one JSON line: {"metric": "bus_throughput", "ours": groups/s,
"baseline": groups/s (medians over the rounds), "ratio": the median of the
rounds' ours/baseline, "ratio_spread": {"runs", "median", "min", "max"},
"groups_s": {variant: {"runs", "median", "min", "max"}}, ...}. A round takes
~1-2 s with ``--quick`` (150 groups), ~5 s by default (600), on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
from confluent_kafka import Consumer, Producer, TopicPartition

from topics.bus import connect
from topics.codec import decode, encode, headers_for
from topics.schemas import Sample, TrajectoryGroup

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.spread import describe, interleaved, spread  # noqa: E402

G, L, PROMPT = 8, 2048, 256


def make_groups(n: int, seed: int = 0) -> list[TrajectoryGroup]:
    """``n`` groups of G samples x L tokens with realistic value distributions."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        samples = []
        for _ in range(G):
            mask = np.zeros(L, np.uint8)
            mask[PROMPT:] = 1
            lp = np.where(mask == 1, -rng.exponential(0.7, L), 0).astype(np.float32)
            versions = np.where(mask == 1, 5, -1).astype(np.int32)
            samples.append(Sample(input_ids=rng.integers(0, 151_000, L, dtype=np.int32), loss_mask=mask,
                                  behavior_logprobs=lp, versions=versions, reward=float(rng.integers(0, 2))))
        out.append(TrajectoryGroup.build(samples=samples, prompt_id=f"p{i}", group_id=uuid.uuid4().hex,
                                         policy="actor", source="bench", task_type="math", producer_id="bench"))
    return out


def run_ours(url: str, groups: list[TrajectoryGroup], partitions: int = 4) -> tuple[float, int]:
    """Encode+produce, then consume+decode+commit through the bus at ``url``; returns (seconds, bytes)."""
    bus = connect(url)
    topic = f"bench-{uuid.uuid4().hex[:8]}"
    bus.admin().create_topic(topic, partitions=partitions)
    consumer = bus.consumer(f"bench-{uuid.uuid4().hex[:8]}")
    consumer.subscribe([topic])
    consumer.poll(1, 0.5)  # join the group before timing
    producer = bus.producer()
    t0 = time.perf_counter()
    nbytes = 0
    for g in groups:
        value = encode(g)
        nbytes += len(value)
        producer.send(topic, value, key=g.prompt_id, headers=headers_for(g))
    producer.flush()
    got = 0
    while got < len(groups):
        batch = consumer.poll(64, 1.0)
        for r in batch:
            decode(r.value, TrajectoryGroup, topic=r.topic, partition=r.partition, offset=r.offset)
        got += len(batch)
        consumer.commit(batch)
    dt = time.perf_counter() - t0
    consumer.close()
    bus.admin().delete_topic(topic)
    return dt, nbytes


def run_raw(bootstrap: str, payloads: list[tuple[str, bytes]], partitions: int = 4) -> float:
    """The same encoded bytes through raw confluent-kafka; returns seconds."""
    bus = connect(f"kafka://{bootstrap}")
    topic = f"bench-raw-{uuid.uuid4().hex[:8]}"
    bus.admin().create_topic(topic, partitions=partitions)
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"raw-{uuid.uuid4().hex[:8]}",
                  "enable.auto.commit": False, "auto.offset.reset": "earliest", "fetch.wait.max.ms": 50})
    c.subscribe([topic])
    c.consume(1, 0.5)
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True, "linger.ms": 5,
                  "message.max.bytes": 64 << 20, "queue.buffering.max.kbytes": 1 << 20})
    t0 = time.perf_counter()
    for key, value in payloads:
        while True:
            try:
                p.produce(topic, value, key)
                break
            except BufferError:
                p.poll(0.1)
        p.poll(0)
    p.flush(60)
    got = 0
    while got < len(payloads):
        msgs = [m for m in c.consume(64, 1.0) if m.error() is None]
        got += len(msgs)
        if msgs:
            offs: dict[tuple[str, int], int] = {}
            for m in msgs:
                offs[(m.topic(), m.partition())] = max(offs.get((m.topic(), m.partition()), 0), m.offset() + 1)
            c.commit(offsets=[TopicPartition(t, q, o) for (t, q), o in offs.items()], asynchronous=False)
    dt = time.perf_counter() - t0
    c.close()
    bus.admin().delete_topic(topic)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="150 groups instead of 600")
    ap.add_argument("--kafka", default="127.0.0.1:9092", help="broker address (host:port)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds of the three variants")
    args = ap.parse_args()
    n = 150 if args.quick else 600
    groups = make_groups(n)
    payloads = [(g.prompt_id, encode(g)) for g in groups]
    mb = sum(len(v) for _, v in payloads) / 1e6
    raw_mb = sum(sum(s.input_ids.nbytes * 3 + s.loss_mask.nbytes for s in g.samples) for g in groups) / 1e6
    print(f"{n} groups, G={G}, L={L}: {raw_mb:.1f} MB of arrays, {mb:.1f} MB encoded; {args.repeats} interleaved "
          f"round(s)")

    names = {"ours": "ours (codec + kafka)", "raw": "raw confluent-kafka", "local": "ours (codec + local://)"}
    seconds: dict[str, list[float]] = {k: [] for k in names}
    with tempfile.TemporaryDirectory() as d:
        run = {"ours": lambda: run_ours(f"kafka://{args.kafka}", groups)[0],
               "raw": lambda: run_raw(args.kafka, payloads),
               "local": lambda: run_ours(f"local://{d}/bus", groups)[0]}
        for r, name in interleaved(tuple(names), args.repeats):
            seconds[name].append(run[name]())
            dt = seconds[name][-1]
            print(f"round {r}: {names[name]:26s} {n / dt:8.1f} groups/s {mb / dt:8.1f} MB/s  ({dt:.2f} s)", flush=True)
    rates = {k: spread([n / dt for dt in v], 1) for k, v in seconds.items()}
    ratio = spread([raw / ours for ours, raw in zip(seconds["ours"], seconds["raw"])], 3)
    for k, name in names.items():
        print(f"{name:26s} groups/s {describe(rates[k], '.1f')}")
    print(f"ours / raw, round by round: {describe(ratio, '.3f')}")
    print(json.dumps({"metric": "bus_throughput", "unit": "groups/s", "ours": rates["ours"]["median"],
                      "baseline": rates["raw"]["median"], "ratio": ratio["median"], "ratio_spread": ratio,
                      "groups_s": rates, "mb_per_group": round(mb / n, 4), "repeats": args.repeats,
                      "local_groups_s": rates["local"]["median"]}))


if __name__ == "__main__":
    main()

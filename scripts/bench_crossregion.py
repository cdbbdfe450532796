#!/usr/bin/env python
"""A RaaS worker in another region: weight pulls over a slow, distant link, and a trainer that never waits.

The remote side is the RaaS worker's weight path (:class:`weights.puller.Puller`, as ``RaasWorker`` builds
it, with its ``weights`` consumer and an :class:`~producers.hf_engine.HFEngine` it loads each version into)
in its own Linux network namespace. Everything it says to the bus and the store crosses one link:

* inside the namespace, ``scripts/latency_proxy.py`` listens on 127.0.0.1 at the broker's port and the S3
  server's port and adds RTT/2 each way (``netem`` is not available on every kernel; a user-space delay
  is). Kafka advertises 127.0.0.1:PORT, so a client in the namespace bootstraps and fetches through it;
* a veth pair to the host, both ends shaped by ``tc`` (htb): the store's traffic at the scaled rate below,
  the bus's at the paper's 4 Gbit/s (bus bytes, announcements and metadata, do not grow with the model, so
  scaling their rate too would turn the shared broker's ~1 MB of metadata into a minute);
* on the host end of the veth, a plain forwarder (the same script, no delay) to the broker and the S3
  server, which listen on the host's 127.0.0.1 only.

The host side is a real trainer process (``python -m astraflow trainer examples/arith-tiny.yaml`` on the
tiny model, in bf16 at lr 1e-6, so versions are sparse deltas, ~98.9% unchanged, as the paper measured),
publishing to a moto S3 server and announcing on the Kafka broker at 127.0.0.1:``--kafka-port``. This
script feeds it one batch of groups (sampled from the tiny model once, re-stamped with the trainer's
version) every ``--pace-s`` seconds, so it publishes one version per batch.

**Scaling the paper's link to the tiny model.** The paper's cross-region link is 4 Gbit/s with 300 ms RTT.
A 7B model in bf16 (``--ref-params`` x 2 bytes, 14 GB) takes 29 s to cross it (TCP payload is 1448/1514
of the wire rate): 98 RTTs. The tiny model is 0.71 MB, which crosses 4 Gbit/s in 1.5 ms, so every pull
would be pure latency and deltas could not matter. The bench keeps the RTT (latency does not shrink with
the model) and scales the store's rate by tiny bytes / 7B bytes (~200 kbit/s): the tiny snapshot takes
the same 29 s, 98 RTTs, as a 7B snapshot on the paper's link, and a delta the same fraction of that. So a
measured pull time is also what a 7B model would see on the paper's link (local CPU work, decoding and
checksums, does not scale, and is a few ms here). The results table splits each pull into the transfer at
the link's rate and the round trips left over, and predicts the tiny model on the unscaled link from those.

Measured:

* ``full_pull_s``: a fresh worker (no weights) pulls the newest full snapshot: list, GET, verify, load
  (median of ``--full-pulls``). This is the baseline.
* ``delta_pull_s``: a live worker one version behind pulls the new version's delta, from the moment it
  reads the announcement to the engine having it (median of ``--delta-pulls``). After the first full pull
  the worker catches up through chains of deltas; those syncs are listed, not counted.
* ``trainer_blocked_s``: the time the trainer's step path spent in the weight path while the remote worker
  was pulling: the sum of its ``publish_wait_s`` (the copy to host memory; encoding, upload and
  announcement run in the publisher's thread) over those steps. It is compared with the steps before the
  remote worker started (``publish_wait_s``, ``step_s``, and the delay from feeding a batch to the trainer
  reporting its step), and the versions published while a full pull was in flight are counted (a
  trainer waiting on the worker would publish none).

moto's server closes every HTTP connection after one response, so each store request pays a new
connection's handshake: two RTTs (an S3 endpoint keeps connections alive, but a new HTTPS connection costs
two or three).

Needs root (namespaces, ``tc``), ``ip`` and ``tc``; a broker on 127.0.0.1:``--kafka-port``
(``scripts/kafka-local.sh start``) and ``moto_server`` (the dev extras). Every wait is bounded and says
what it waited for; the namespace, veth, qdiscs, processes and the run's topics are removed on exit, on
error and on Ctrl-C (or SIGTERM).

Ends with one JSON line ``{"metric": "crossregion", "delta_pull_s", "full_pull_s", "baseline" (=
full_pull_s), "ratio" (full / delta, medians), "ratio_range" ([slowest delta against fastest full, fastest
delta against slowest full]), "full_pulls_s" and "delta_pulls_s" (every pull: {"runs", "median", "min",
"max"}), "trainer_blocked_s", "link": {...}, ...}``. Full and delta pulls are different states of a worker
(fresh, live), so they run in turn, not interleaved; every pull is printed as it ends.

Usage: ``scripts/bench_crossregion.py [--quick] [--kafka-port 9092] [--rtt-ms 300] [--paper-gbit 4]
[--ref-params 7e9] [--pace-s 5] [--full-pulls N] [--delta-pulls N] [--steps-without N]``. ``--quick``:
one full pull, 2 delta pulls, 3 steps without the remote worker (~2 minutes); the default: 3, 8 and 8.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from producers.ports import free_port  # noqa: E402
from scripts.spread import describe, spread  # noqa: E402

PROXY = ROOT / "scripts" / "latency_proxy.py"
CONFIG = ROOT / "examples" / "arith-tiny.yaml"
POLICY = "actor"
#: TCP payload per byte on the wire: a 1,448-byte segment (MSS with timestamps) in a 1,514-byte Ethernet frame
PAYLOAD = 1448 / 1514
#: S3 credentials for the moto server (it accepts any)
S3_ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
          "AWS_DEFAULT_REGION": "us-east-1"}


class BenchError(RuntimeError):
    """A component failed or a bounded wait ran out (the message names what was waited for)."""


def require_privileges() -> None:
    """Exit (status 1, with a message saying what is missing) unless this process is root and ``ip`` and
    ``tc`` are installed."""
    if os.geteuid() != 0:
        sys.exit("bench_crossregion: needs root (it creates a network namespace, a veth pair and tc qdiscs)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"bench_crossregion: {' and '.join(missing)} not found (install iproute2)")


def run_cmd(*argv: str, timeout_s: float = 30.0) -> None:
    """Run ``argv`` to completion.

    Raises:
        BenchError: it exited non-zero (its stderr in the message) or ran longer than ``timeout_s`` seconds.
    """
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise BenchError(f"`{' '.join(argv)}` did not finish in {timeout_s:.0f} s") from None
    if done.returncode:
        raise BenchError(f"`{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip()}")


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM ``proc``, then SIGKILL it if it is still running after ``grace_s`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class Lines:
    """The stdout lines of a child process (started with ``stdout=PIPE, text=True``), read by a thread so
    that waits can be bounded; ``name`` says who it is in errors."""

    def __init__(self, proc: subprocess.Popen, name: str):
        self.proc, self.name = proc, name
        self._queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, name=f"lines-{name}", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))

    def get(self, timeout_s: float) -> str | None:
        """The next line, waiting up to ``timeout_s`` seconds; None when none came."""
        try:
            return self._queue.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            return None

    def expect(self, wanted: str, timeout_s: float) -> None:
        """Wait for the line ``wanted``.

        Raises:
            BenchError: the process exited, or ``timeout_s`` seconds passed, first.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.get(min(0.2, deadline - time.monotonic()))
            if line == wanted:
                return
            if line is None and self.proc.poll() is not None:
                raise BenchError(f"{self.name} exited {self.proc.returncode} before printing {wanted!r}")
        raise BenchError(f"timed out after {timeout_s:.0f} s waiting for {self.name} to print {wanted!r}")


class Link:
    """A network namespace joined to this host over a delayed link with a rate per port.

    Inside the namespace, connections to 127.0.0.1:P (P a key of ``rates``) cross a latency proxy (RTT/2
    each way), a veth pair and a forwarder on the host end, to 127.0.0.1:P on the host. Both ends of the
    veth shape their egress with htb: the traffic of port P at ``rates[P]`` each way, anything else at the
    highest of the rates; generic segmentation offload is off, so that the shaper sees packets rather than
    64 KB bursts. Use it as a context manager (or :meth:`open`, then :meth:`close`, which removes whatever
    was made, even after a failed :meth:`open`).

    Args:
        rates: port -> rate of its traffic each way, bit/s (the host's 127.0.0.1 ports reachable from the
            namespace, at the same numbers).
        rtt_s: the round-trip time the proxy adds, seconds.
        tag: a suffix for the names of the namespace and the veth ends (default: random); at most 8
            characters, as a veth name has at most 15.

    Attributes:
        netns: the namespace's name. host_ip, ns_ip: the two ends' addresses (a /30 in 10.231.0.0/16).

    Raises:
        ValueError: ``tag`` is longer than 8 characters, or ``rates`` is empty.
    """

    def __init__(self, rates: dict[int, int], rtt_s: float, tag: str | None = None):
        tag = tag or uuid.uuid4().hex[:8]
        if len(tag) > 8 or not rates:
            raise ValueError(f"need a tag of at most 8 characters ({tag!r}) and at least one port ({rates})")
        self.rates, self.rtt_s = dict(rates), rtt_s
        self.netns, self._veth_host, self._veth_ns = f"afx-{tag}", f"afx{tag}h", f"afx{tag}n"
        base = random.Random(tag).randrange(0, 1 << 14) * 4  # a /30 in 10.231.0.0/16
        self.host_ip = f"10.231.{base >> 8}.{(base & 255) + 1}"
        self.ns_ip = f"10.231.{base >> 8}.{(base & 255) + 2}"
        self._procs: list[subprocess.Popen] = []

    def exec_argv(self, *argv: str) -> list[str]:
        """``argv`` run inside the namespace (``ip netns exec``)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def _shape(self, device: str, inside: bool) -> None:
        """htb on ``device``'s egress: a class per port (matched as the source port on the host end, the
        destination port on the namespace's end), the rest in a default class at the highest rate."""
        ns = self.exec_argv if inside else (lambda *argv: list(argv))
        run_cmd(*ns("ip", "link", "set", "dev", device, "gso_max_segs", "1"))
        top = max(self.rates.values())
        run_cmd(*ns("tc", "qdisc", "add", "dev", device, "root", "handle", "1:", "htb", "default", "1"))
        for minor, (port, rate) in enumerate([(None, top), *self.rates.items()], start=1):
            burst = str(max(4096, rate // 8 // 100))  # 10 ms of the rate, at least a few packets
            run_cmd(*ns("tc", "class", "add", "dev", device, "parent", "1:", "classid", f"1:{minor}", "htb",
                        "rate", f"{rate}bit", "ceil", f"{rate}bit", "burst", burst, "cburst", burst,
                        "quantum", "1514"))
            if port is not None:
                run_cmd(*ns("tc", "filter", "add", "dev", device, "parent", "1:", "protocol", "ip", "u32", "match",
                            "ip", "dport" if inside else "sport", str(port), "0xffff", "flowid", f"1:{minor}"))

    def open(self) -> "Link":
        """Create the namespace, the veth pair, the shapers and the two proxies.

        Raises:
            BenchError: a step failed (e.g. the names exist already) or a proxy did not start in 20 s.
        """
        run_cmd("ip", "netns", "add", self.netns)
        run_cmd("ip", "link", "add", self._veth_host, "type", "veth", "peer", "name", self._veth_ns)
        run_cmd("ip", "link", "set", self._veth_ns, "netns", self.netns)
        run_cmd("ip", "addr", "add", f"{self.host_ip}/30", "dev", self._veth_host)
        run_cmd("ip", "link", "set", self._veth_host, "up")
        run_cmd(*self.exec_argv("ip", "addr", "add", f"{self.ns_ip}/30", "dev", self._veth_ns))
        run_cmd(*self.exec_argv("ip", "link", "set", self._veth_ns, "up"))
        run_cmd(*self.exec_argv("ip", "link", "set", "lo", "up"))
        self._shape(self._veth_host, inside=False)
        self._shape(self._veth_ns, inside=True)
        self._proxy([sys.executable, str(PROXY), *(f"{self.host_ip}:{p}=127.0.0.1:{p}" for p in self.rates)],
                    "the host-side forwarder")
        self._proxy(self.exec_argv(sys.executable, str(PROXY), f"--one-way-ms={self.rtt_s * 500}",
                                   *(f"127.0.0.1:{p}={self.host_ip}:{p}" for p in self.rates)),
                    "the latency proxy in the namespace")
        return self

    def _proxy(self, argv: list[str], name: str) -> None:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
        self._procs.append(proc)
        Lines(proc, name).expect("ready", 20)

    def close(self) -> None:
        """Stop the proxies and delete the namespace and the veth pair (with their qdiscs); each step runs
        even when an earlier one failed, and what does not exist is skipped."""
        for proc in self._procs:
            stop_process(proc, 5)
        if self.exists()["netns"]:
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, timeout=30)
        if self.exists()["veth"]:
            subprocess.run(["ip", "link", "del", self._veth_host], capture_output=True, timeout=30)

    def exists(self) -> dict[str, bool]:
        """Whether the namespace and the host's veth end exist now (for checking a teardown)."""
        return {"netns": self.netns in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                      text=True).stdout.split(),
                "veth": subprocess.run(["ip", "link", "show", self._veth_host], capture_output=True).returncode == 0}

    def __enter__(self) -> "Link":
        try:
            return self.open()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()


def start_moto(port: int, log_path: Path) -> subprocess.Popen:
    """A moto S3 server on 127.0.0.1:``port`` (``moto_server`` next to this Python), once it answers.

    Raises:
        BenchError: ``moto_server`` is not installed, or did not answer within 30 s.
    """
    import httpx

    exe = Path(sys.executable).with_name("moto_server")
    if not exe.is_file():
        raise BenchError(f"{exe} not found: install the dev extras (scripts/install.sh dev)")
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}", timeout=1)
            return proc
        except httpx.HTTPError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_process(proc)
                raise BenchError(f"moto_server did not answer on 127.0.0.1:{port} in 30 s (see {log_path})")
            time.sleep(0.1)


def sample_groups(model_dir: Path, n_groups: int, group_size: int) -> list:
    """``n_groups`` TrajectoryGroups of ``group_size`` samples, rolled out by an HFEngine on the tiny
    model with the single-turn workflow and the example's sampling settings, on ``arith`` prompts."""
    from astraflow.config import load_config
    from producers.engines import SamplingParams
    from producers.hf_engine import HFEngine
    from producers.sources import load_source
    from producers.workflows import get_workflow

    cfg = load_config(CONFIG, [])
    engine = HFEngine(model_dir)
    workflow = get_workflow(cfg.workflow.name, policies=cfg.workflow.roles or None)
    sampling = SamplingParams(max_new_tokens=cfg.sampling.max_new_tokens, temperature=cfg.sampling.temperature,
                              top_p=cfg.sampling.top_p)
    source = load_source("arith", seed=cfg.seed)
    groups = []
    for i in range(n_groups):
        groups.extend(workflow.run(source[i].model_copy(update={"n_samples": group_size}), {POLICY: engine},
                                   sampling))
    return groups


def stamp(group, version: int):
    """A copy of ``group`` under a new ``group_id`` whose generated tokens carry ``version`` (the trainer's
    version when it is fed, so it is trained at staleness 0 and never dropped)."""
    import numpy as np

    from topics.schemas import TrajectoryGroup

    samples = [s.model_copy(update={"versions": np.where(s.versions >= 0, version, -1).astype(np.int32)})
               for s in group.samples]
    return TrajectoryGroup.build(samples=samples, prompt_id=group.prompt_id, group_id=uuid.uuid4().hex,
                                 policy=group.policy, source=group.source, task_type=group.task_type,
                                 workflow=group.workflow, producer_id="bench-crossregion")


# ---- the remote worker (runs inside the namespace) ---------------------------------------------------------


def remote_main(spec: dict) -> None:
    """The remote worker's weight path, inside the namespace; prints one JSON event per line.

    It imports and loads its engine, prints ``loaded`` and waits for a ``go`` line on stdin before it sends
    anything over the link. Events:

    * ``ready``: ``http_request_s``, one HTTP request to the store (on a new connection: moto closes each);
    * ``full``: a fresh worker's full pull: version, bytes, s, wall-clock start and end, and ``join_s``,
      from making its puller to reading the announcement;
    * ``pull``: a live worker's sync: from, to, the kinds announced for the versions in between, the
      newest one's bytes, s, and the seconds from its announcement to reading it (``announce_to_seen_s``,
      which includes waiting for a sync in progress) and to the engine having it (``announce_to_loaded_s``);
    * ``done``; or ``error`` (then it exits 1) when waiting ran past ``spec["timeout_s"]`` seconds.

    Args:
        spec: run, store (URI), s3_port, bus (URL), model_dir, full_pulls, delta_pulls, timeout_s.
    """
    import http.client

    import torch

    torch.set_num_threads(1)
    from producers.hf_engine import HFEngine
    from topics.bus import connect
    from topics.names import TopicNames
    from weights.puller import Puller
    from weights.store import WeightStore

    def emit(event: str, **fields) -> None:
        print(json.dumps({"event": event, **fields}), flush=True)

    def check(what: str) -> None:
        if time.monotonic() > deadline:
            emit("error", msg=f"remote worker: timed out after {spec['timeout_s']} s waiting for {what}")
            sys.exit(1)

    engine = HFEngine(spec["model_dir"])
    emit("loaded")
    if sys.stdin.readline().strip() != "go":  # the host's signal to start; no traffic crosses the link before
        return
    deadline = time.monotonic() + spec["timeout_s"]
    conn = http.client.HTTPConnection("127.0.0.1", spec["s3_port"], timeout=30)
    t0 = time.perf_counter()
    conn.request("GET", "/")
    conn.getresponse().read()
    http_s = time.perf_counter() - t0
    conn.close()
    store = WeightStore(spec["store"], spec["run"], endpoint=f"http://127.0.0.1:{spec['s3_port']}",
                        access_key_id="test", secret_access_key="test", region="us-east-1")
    bus = connect(spec["bus"])
    names = TopicNames(spec["run"])
    emit("ready", http_request_s=http_s)

    def full_pull() -> Puller:
        """A fresh worker (no weights) pulls the newest announced full snapshot; returns its puller."""
        t_join = time.perf_counter()
        puller = Puller(store, bus, names, POLICY, on_update=engine.load_weights)
        while not any(a.kind == "full" for a in puller.announced.values()):
            check("an announced full snapshot")
            puller.poll(timeout_s=1.0)
        version = max(v for v, a in puller.announced.items() if a.kind == "full")
        size = puller.announced[version].bytes
        start, t0 = time.time(), time.perf_counter()
        puller.sync(version)
        emit("full", version=version, bytes=size, s=time.perf_counter() - t0, start=start, end=time.time(),
             join_s=t0 - t_join)
        return puller

    puller = full_pull()
    singles, last_s = 0, None
    while singles < spec["delta_pulls"]:  # catch up, then one version at a time
        check(f"{spec['delta_pulls']} one-version delta pulls (got {singles}; the last sync took {last_s} s: "
              f"if that is longer than the pace of versions, raise --pace-s)")
        puller.poll(timeout_s=0.5)
        t0, seen = time.perf_counter(), time.time()
        target = puller.newest_durable()
        if target is None or target <= puller.version:
            continue
        behind = [puller.announced[v] for v in sorted(puller.announced) if puller.version < v <= target]
        start = puller.version
        puller.sync(target)
        last_s = round(time.perf_counter() - t0, 2)
        kinds = [a.kind for a in behind]
        emit("pull", **{"from": start}, to=target, kinds=kinds, bytes=behind[-1].bytes, s=time.perf_counter() - t0,
             announce_to_loaded_s=time.time() - behind[-1].created_ts, announce_to_seen_s=seen - behind[-1].created_ts)
        singles += kinds == ["delta"]
    puller.close()
    for _ in range(spec["full_pulls"] - 1):
        full_pull().close()
    emit("done")


# ---- the host side ------------------------------------------------------------------------------------------


class TrainerFeed:
    """The trainer process, the batches fed to it and the step metrics it reports on ``metrics``.

    Args:
        bus, names: the bus and the run's topic names.
        groups: the groups to feed, over and over (:func:`stamp` gives each a new id and version).
        batch_groups: groups per batch (the trainer's ``batch_groups``, so one batch is one step).
        proc, log_path: the trainer process and its output, for errors.

    Attributes:
        fed: batch number k (from 1) -> wall-clock time it was flushed to ``samples.<policy>``.
        steps: trainer step k -> ``{"ts", **metric values}`` from its Metric record.
    """

    def __init__(self, bus, names, groups: list, batch_groups: int, proc: subprocess.Popen, log_path: Path):
        from topics.follow import Follower
        from topics.schemas import Metric

        self.names, self.groups, self.batch_groups = names, groups, batch_groups
        self.proc, self.log_path = proc, log_path
        self.producer = bus.producer()
        self.metrics = Follower(bus, names.metrics, Metric, client_id="bench-crossregion-metrics")
        self.fed: dict[int, float] = {}
        self.steps: dict[int, dict] = {}

    def feed(self) -> int:
        """Send the next batch (``batch_groups`` groups at the trainer's next version - 1); returns its number."""
        from topics.codec import encode, headers_for

        k = len(self.fed) + 1
        for i in range(self.batch_groups):
            g = stamp(self.groups[(k * self.batch_groups + i) % len(self.groups)], k - 1)
            self.producer.send(self.names.samples(POLICY), encode(g), key=g.prompt_id, headers=headers_for(g))
        self.producer.flush()
        self.fed[k] = time.time()
        return k

    def pump(self, timeout_s: float) -> None:
        """Read new step metrics, waiting up to ``timeout_s`` seconds for the first.

        Raises:
            BenchError: the trainer process exited.
        """
        for _, m in self.metrics.poll(timeout_s):
            if m.component == f"trainer.{POLICY}" and m.step is not None:
                self.steps[m.step] = {"ts": m.ts, **m.values}
        if self.proc.poll() is not None:
            raise BenchError(f"the trainer exited {self.proc.returncode}; its log:\n"
                             f"{self.log_path.read_text()[-3000:]}")

    def wait_step(self, step: int, timeout_s: float, what: str) -> None:
        """Pump until trainer step ``step`` is reported.

        Raises:
            BenchError: not within ``timeout_s`` seconds (the message names ``what``), or the trainer exited.
        """
        deadline = time.monotonic() + timeout_s
        while step not in self.steps:
            if time.monotonic() > deadline:
                raise BenchError(f"timed out after {timeout_s:.0f} s waiting for trainer step {step} ({what}); "
                                 f"trainer log: {self.log_path}")
            self.pump(0.2)

    def close(self) -> None:
        """Stop reading metrics and flush the producer."""
        self.metrics.close()
        self.producer.close()


def start_trainer(args, kafka: str, run: str, run_dir: Path, bucket: str, s3_port: int,
                  log_path: Path) -> subprocess.Popen:
    """``python -m astraflow trainer`` on the example config: the tiny model in bf16 at lr 1e-6, batches of
    ``args.batch_groups`` groups, on the broker at ``kafka`` (HOST:PORT) and the S3 bucket ``bucket`` of the
    moto server on ``s3_port``; its output goes to ``log_path``."""
    cmd = [sys.executable, "-m", "astraflow", "trainer", str(CONFIG), "--policy", POLICY, f"run={run}",
           f"run_dir={run_dir}", f"bus=kafka://{kafka}", f"store=s3://{bucket}/w",
           "policies.actor.trainer.param_dtype=bfloat16", "policies.actor.trainer.lr=1.0e-6",
           f"policies.actor.batch_groups={args.batch_groups}", "policies.actor.steps=1000000",
           "policies.actor.checkpoint_every=1000000"]
    env = dict(os.environ, OMP_NUM_THREADS="1", AWS_ENDPOINT_URL=f"http://127.0.0.1:{s3_port}", **S3_ENV)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def quietly(fn, *args) -> None:
    """``fn(*args)``, printing (not raising) what it raised: for clean-up steps that must not stop the others."""
    try:
        fn(*args)
    except Exception as e:
        print(f"bench_crossregion: clean-up step failed: {type(e).__name__}: {e}", file=sys.stderr)


def kafka_reachable(address: str) -> bool:
    """Whether a TCP connection to ``address`` (HOST:PORT) opens within 2 s."""
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return True
    except OSError:
        return False


def measure(args, model_dir: Path, rate_bit: int, bus_rate_bit: int, work: Path) -> dict:
    """Set everything up, run both phases, tear everything down; returns the raw measurements.

    Raises:
        BenchError: a component failed or a wait ran out.
    """
    import httpx

    from topics.bus import connect
    from topics.layout import ensure_run_topics
    from topics.names import TopicNames

    t_start = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:5.1f} s] {msg}", flush=True)

    run, bucket = f"xregion{uuid.uuid4().hex[:8]}", f"xregion-{uuid.uuid4().hex[:8]}"
    kafka, s3_port = f"127.0.0.1:{args.kafka_port}", free_port()
    with ExitStack() as stack:
        moto = start_moto(s3_port, work / "moto.log")
        stack.callback(stop_process, moto)
        httpx.put(f"http://127.0.0.1:{s3_port}/{bucket}").raise_for_status()
        link = stack.enter_context(Link({s3_port: rate_bit, args.kafka_port: bus_rate_bit}, args.rtt_ms / 1000))
        say(f"link: namespace {link.netns} ({link.ns_ip}) <-> host {link.host_ip}, RTT {args.rtt_ms:.0f} ms; store "
            f"{rate_bit / 1e3:.1f} kbit/s, bus {bus_rate_bit / 1e9:g} Gbit/s each way")
        spec = {"run": run, "store": f"s3://{bucket}/w", "s3_port": s3_port, "bus": f"kafka://{kafka}",
                "model_dir": str(model_dir), "full_pulls": args.full_pulls, "delta_pulls": args.delta_pulls,
                "timeout_s": args.remote_timeout_s}
        remote_log = work / "remote.log"
        remote = subprocess.Popen(
            link.exec_argv(sys.executable, str(Path(__file__).resolve()), "--_remote", json.dumps(spec)),
            cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=open(remote_log, "w"), text=True, start_new_session=True)
        stack.callback(stop_process, remote, 5)
        events = Lines(remote, "the remote worker")
        groups = sample_groups(model_dir, n_groups=8, group_size=args.group)
        bus = connect(f"kafka://{kafka}")
        names = TopicNames(run)
        admin = bus.admin()
        ensure_run_topics(admin, names, [POLICY])
        stack.callback(quietly, lambda: [admin.delete_topic(t) for t in admin.list_topics() if t.startswith(f"{run}.")])
        trainer_log = work / "trainer.log"
        trainer = start_trainer(args, kafka, run, work / run, bucket, s3_port, trainer_log)
        stack.callback(stop_process, trainer, 60)
        feed = TrainerFeed(bus, names, groups, args.batch_groups, trainer, trainer_log)
        stack.callback(feed.close)

        feed.feed()
        feed.wait_step(1, 240, "its first step: start-up, model load, first publish")
        say("the trainer published version 1 (a full snapshot)")
        # phase A: the trainer alone (the remote worker has loaded its engine and waits, silent)
        tick = time.monotonic()
        for _ in range(args.steps_without):
            tick += args.pace_s
            while time.monotonic() < tick:
                feed.pump(min(0.2, max(tick - time.monotonic(), 0.0)))
            feed.feed()
        without = list(range(2, len(feed.fed) + 1))
        feed.wait_step(len(feed.fed), 60, "the last step without the remote worker")
        say(f"trainer alone: {len(without)} steps, one every {args.pace_s} s")

        # phase B: the remote worker pulls while the trainer goes on
        events.expect(json.dumps({"event": "loaded"}), 120)
        remote.stdin.write("go\n")
        remote.stdin.flush()
        out = {"fulls": [], "pulls": [], "ready": None}
        deadline = time.monotonic() + args.remote_timeout_s + 60
        tick = time.monotonic()
        while True:
            if time.monotonic() > deadline:
                raise BenchError(f"timed out after {args.remote_timeout_s + 60:.0f} s waiting for the remote "
                                 f"worker to finish (log: {remote_log})")
            if time.monotonic() >= tick:
                feed.feed()
                tick += args.pace_s
            line = events.get(0.05)
            feed.pump(0.0)
            if line is None:
                if remote.poll() is not None:
                    raise BenchError(f"the remote worker exited {remote.returncode}:\n"
                                     f"{remote_log.read_text()[-3000:]}")
                continue
            event = json.loads(line)
            kind = event.pop("event")
            if kind == "error":
                raise BenchError(event["msg"])
            if kind == "ready":
                out["ready"] = dict(event, at=time.time())
                say(f"remote worker connected: an HTTP request to the store took {event['http_request_s']:.3f} s")
            elif kind == "full":
                out["fulls"].append(event)
                say(f"remote full pull: version {event['version']}, {event['bytes']} B in {event['s']:.2f} s "
                    f"(after {event['join_s']:.2f} s to join the weights stream)")
            elif kind == "pull":
                out["pulls"].append(event)
                kinds = ", ".join(f"{event['kinds'].count(k)} x {k}" for k in sorted(set(event['kinds'])))
                say(f"remote sync {event['from']} -> {event['to']} ({kinds}) in {event['s']:.2f} s")
            elif kind == "done":
                out["done_at"] = time.time()
                break
        with_remote = [k for k, t in feed.fed.items() if out["ready"]["at"] <= t <= out["done_at"]]
        feed.wait_step(len(feed.fed), 60, "the last step fed while the remote worker pulled")
        trainer.terminate()  # it checkpoints and exits while the rest is torn down
        out.update(steps=dict(feed.steps), fed=dict(feed.fed), without=without, with_remote=with_remote)
        say("done; tearing down")
    return out


def summarize(raw: dict) -> dict:
    """The figures of the run (seconds, bytes) from :func:`measure`'s raw measurements."""
    steps, fed = raw["steps"], raw["fed"]
    fulls = raw["fulls"]
    singles = [p for p in raw["pulls"] if p["kinds"] == ["delta"]]
    if not fulls or not singles:
        raise BenchError(f"no {'full' if not fulls else 'one-version delta'} pull was measured")
    full_s = statistics.median(f["s"] for f in fulls)
    delta_s = statistics.median(p["s"] for p in singles)
    full_bytes = statistics.median(f["bytes"] for f in fulls)
    delta_bytes = statistics.median(p["bytes"] for p in singles)

    def phase(ks: list[int]) -> dict:
        rows = [steps[k] for k in ks if k in steps]
        return {"steps": len(rows), "publish_wait_s": sum(r["publish_wait_s"] for r in rows),
                "publish_wait_ms_max": 1e3 * max(r["publish_wait_s"] for r in rows),
                "step_s_median": statistics.median(r["step_s"] for r in rows),
                "fed_to_step_s_median": statistics.median(steps[k]["ts"] - fed[k] for k in ks if k in steps),
                "fed_to_step_s_max": max(steps[k]["ts"] - fed[k] for k in ks if k in steps)}

    without, with_remote = phase(raw["without"]), phase(raw["with_remote"])
    during_full = sum(1 for f in fulls for s in steps.values() if f["start"] <= s["ts"] <= f["end"])
    return {
        "full_pull_s": full_s, "delta_pull_s": delta_s, "full_bytes": full_bytes, "delta_bytes": delta_bytes,
        "full_pulls": [round(f["s"], 3) for f in fulls], "join_s": statistics.median(f["join_s"] for f in fulls), "delta_pulls": [round(p["s"], 3) for p in singles],
        "announce_to_loaded_s": statistics.median(p["announce_to_loaded_s"] for p in singles),
        "announce_to_seen_s": statistics.median(p["announce_to_seen_s"] for p in singles),
        "catch_up": [{"versions": p["to"] - p["from"], "s": round(p["s"], 3)} for p in raw["pulls"]
                     if p["kinds"] != ["delta"]],
        "http_request_s": raw["ready"]["http_request_s"],
        "without": without, "with_remote": with_remote,
        "trainer_blocked_s": with_remote["publish_wait_s"],
        "versions_during_full_pulls": during_full,
        "full_pull_time_total_s": sum(f["s"] for f in fulls),
    }


def transfer_s(nbytes: float, rate_bit: float) -> float:
    """Seconds to move ``nbytes`` of TCP payload at ``rate_bit`` on the wire (:data:`PAYLOAD` of it)."""
    return nbytes * 8 / (rate_bit * PAYLOAD)


def main() -> None:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 full pull, 2 delta pulls, 3 steps without (~2 min)")
    ap.add_argument("--kafka-port", type=int, default=9092,
                    help="the broker's port on this host's 127.0.0.1 (scripts/kafka-local.sh start)")
    ap.add_argument("--rtt-ms", type=float, default=300.0, help="the link's round-trip time (the paper's: 300)")
    ap.add_argument("--paper-gbit", type=float, default=4.0, help="the paper's link rate, Gbit/s")
    ap.add_argument("--ref-params", type=float, default=7e9,
                    help="parameters of the model the link is scaled for (bf16, 2 bytes each)")
    ap.add_argument("--pace-s", type=float, default=5.0,
                    help="seconds between batches fed to the trainer (longer than a one-delta pull)")
    ap.add_argument("--batch-groups", type=int, default=4, help="groups per trainer step")
    ap.add_argument("--group", type=int, default=4, help="samples per group")
    ap.add_argument("--full-pulls", type=int, default=None, help="full pulls by fresh workers (default 3; 1 quick)")
    ap.add_argument("--delta-pulls", type=int, default=None, help="one-version delta pulls (default 8; 2 quick)")
    ap.add_argument("--steps-without", type=int, default=None,
                    help="trainer steps before the remote worker starts (default 8; 3 quick)")
    ap.add_argument("--remote-timeout-s", type=float, default=600.0, help="bound on the remote worker's run")
    ap.add_argument("--_remote", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._remote is not None:
        remote_main(json.loads(args._remote))
        return
    args.full_pulls = args.full_pulls or (1 if args.quick else 3)
    args.delta_pulls = args.delta_pulls or (2 if args.quick else 8)
    args.steps_without = args.steps_without or (3 if args.quick else 8)
    require_privileges()
    if not kafka_reachable(f"127.0.0.1:{args.kafka_port}"):
        sys.exit(f"bench_crossregion: no Kafka broker at 127.0.0.1:{args.kafka_port}; start one with "
                 f"KAFKA_PORT={args.kafka_port} scripts/kafka-local.sh start")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM cleans up as Ctrl-C does

    from trainer.model import load_causal_lm
    from weights.models import tiny_model_dir

    model_dir = tiny_model_dir()
    model_bytes = sum(t.numel() * 2 for t in load_causal_lm(model_dir, "bfloat16").state_dict().values())
    ref_bytes = args.ref_params * 2
    paper_bit, rtt = args.paper_gbit * 1e9, args.rtt_ms / 1000
    scale = ref_bytes / model_bytes
    rate_bit = int(paper_bit / scale)
    print("| link | model bytes | rate | RTT | full snapshot transfer | in RTTs |\n|---|---|---|---|---|---|")
    print(f"| paper: {args.ref_params / 1e9:.0f}B bf16 | {ref_bytes / 1e9:.1f} GB | {args.paper_gbit:g} Gbit/s | "
          f"{args.rtt_ms:.0f} ms | {transfer_s(ref_bytes, paper_bit):.1f} s | "
          f"{transfer_s(ref_bytes, paper_bit) / rtt:.0f} |")
    print(f"| this bench: tiny model | {model_bytes / 1e6:.2f} MB | {rate_bit / 1e3:.1f} kbit/s | "
          f"{args.rtt_ms:.0f} ms | {transfer_s(model_bytes, rate_bit):.1f} s | "
          f"{transfer_s(model_bytes, rate_bit) / rtt:.0f} |", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-crossregion-") as tmp:
        try:
            raw = measure(args, model_dir, rate_bit, int(paper_bit), Path(tmp))
        except KeyboardInterrupt:
            sys.exit("bench_crossregion: interrupted; everything it started was removed")
        except BenchError as e:
            sys.exit(f"bench_crossregion: {e}")
    res = summarize(raw)

    print("\n| pull | bytes | measured (= 7B on the paper's link) | transfer at the link's rate | round trips "
          "(the rest / RTT) | tiny model on the paper's link (predicted) |\n|---|---|---|---|---|---|")
    for name, s, b in (("full snapshot (fresh worker)", res["full_pull_s"], res["full_bytes"]),
                       ("sparse delta (live worker)", res["delta_pull_s"], res["delta_bytes"])):
        moving = transfer_s(b, rate_bit)
        trips = max(s - moving, 0.0) / rtt
        print(f"| {name} | {b:,.0f} | {s:.2f} s | {moving:.2f} s | {trips:.1f} | "
              f"{trips * rtt + transfer_s(b, paper_bit):.2f} s |")
    fulls, deltas = spread(res["full_pulls"], 3), spread(res["delta_pulls"], 3)
    print(f"full pulls: {describe(fulls, '.2f')} s; one-version delta pulls: {describe(deltas, '.2f')} s")
    for c in res["catch_up"]:
        print(f"(catch-up after the full pull: {c['versions']} versions in {c['s']:.2f} s)")
    w, r = res["without"], res["with_remote"]
    print("\n| trainer | steps | publish wait, total | publish wait, max | step_s median | fed -> step median | "
          "fed -> step max |\n|---|---|---|---|---|---|---|")
    for name, p in (("alone", w), ("remote worker pulling", r)):
        print(f"| {name} | {p['steps']} | {p['publish_wait_s'] * 1e3:.1f} ms | {p['publish_wait_ms_max']:.2f} ms | "
              f"{p['step_s_median']:.3f} s | {p['fed_to_step_s_median']:.3f} s | {p['fed_to_step_s_max']:.3f} s |")
    print(f"\ntrainer_blocked_s = {res['trainer_blocked_s']:.4f} s over {r['steps']} steps; it published "
          f"{res['versions_during_full_pulls']} versions during {res['full_pull_time_total_s']:.1f} s of full pulls "
          f"(one batch every {args.pace_s} s); a version reached the remote engine "
          f"{res['announce_to_loaded_s']:.2f} s after its announcement (median; read after "
          f"{res['announce_to_seen_s']:.2f} s)")
    print(json.dumps({
        "metric": "crossregion", "delta_pull_s": round(res["delta_pull_s"], 3),
        "full_pull_s": round(res["full_pull_s"], 3), "baseline": round(res["full_pull_s"], 3),
        "ratio": round(res["full_pull_s"] / res["delta_pull_s"], 2), "unit": "s",
        "trainer_blocked_s": round(res["trainer_blocked_s"], 5),
        "link": {"store_rate_bit_s": rate_bit, "bus_rate_bit_s": paper_bit, "rtt_s": rtt, "paper_rate_bit_s": paper_bit,
                 "ref_model_bytes": ref_bytes, "model_bytes": model_bytes, "scale": round(scale),
                 "full_transfer_over_rtt": round(transfer_s(model_bytes, rate_bit) / rtt, 1)},
        "full_bytes": res["full_bytes"], "delta_bytes": res["delta_bytes"],
        "full_pulls_s": fulls, "join_s": round(res["join_s"], 3), "delta_pulls_s": deltas, "catch_up": res["catch_up"],
        "ratio_range": None if not deltas["min"] else [round(fulls["min"] / deltas["max"], 2),
                                                        round(fulls["max"] / deltas["min"], 2)],
        "announce_to_loaded_s": round(res["announce_to_loaded_s"], 3),
        "announce_to_seen_s": round(res["announce_to_seen_s"], 3), "http_request_s": round(res["http_request_s"], 3),
        "versions_during_full_pulls": res["versions_during_full_pulls"],
        "trainer_alone": {k: round(v, 5) for k, v in w.items()},
        "trainer_with_remote": {k: round(v, 5) for k, v in r.items()},
        "pace_s": args.pace_s,
    }))


if __name__ == "__main__":
    main()

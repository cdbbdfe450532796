"""Publisher and puller on both buses (embedded, real Kafka) and real stores (local directory, moto S3 server)."""
import logging
import shutil
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

import topics.bus as bus_api
from topics.names import TopicNames
from weights.codec import bits
from weights.publisher import Publisher
from weights.puller import Puller, WeightsUnavailable
from weights.store import WeightStore


class HeldStore(WeightStore):
    """A real store whose uploads wait until the test opens ``gate`` (a distant bucket, as slow as the test wants);
    ``entered`` is set once an upload waits there. A gate not opened within ``hold_s`` fails the upload."""

    hold_s = 60.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate, self.entered = threading.Event(), threading.Event()

    def put(self, key, data):
        self.entered.set()
        if not self.gate.wait(self.hold_s):
            raise RuntimeError(f"the test did not open the gate within {self.hold_s} s")
        super().put(key, data)


class StaleListingStore(WeightStore):
    """A real store whose listing lags deletions (as S3 listings may): it keeps its first listing."""

    _listing = None

    def objects(self, policy):
        if self._listing is None:
            self._listing = super().objects(policy)
        return self._listing


class Trainer:
    """A tiny bf16 model trained by AdamW on random tokens: real optimizer steps."""

    def __init__(self, seed=0):
        torch.manual_seed(seed)
        torch.set_num_threads(1)
        self.model = torch.nn.Sequential(torch.nn.Embedding(64, 48), torch.nn.Linear(48, 96), torch.nn.GELU(),
                                         torch.nn.Linear(96, 64)).to(torch.bfloat16)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=2e-5)

    def step(self):
        x = torch.randint(0, 64, (16, 16))
        logits = self.model(x[:, :-1]).flatten(0, 1).float()
        loss = torch.nn.functional.cross_entropy(logits, x[:, 1:].flatten())
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def snapshot(self):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def assert_bit_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(bits(a[k]), bits(b[k])), k


@pytest.fixture
def run(bus_url):
    bus = bus_api.connect(bus_url)
    names = TopicNames(f"w-{uuid.uuid4().hex[:10]}")
    bus.admin().create_topic(names.weights, partitions=1, compacted=True)
    return bus, names


def wait_newest(puller, version, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while puller.poll(timeout_s=0.5) != version:
        assert time.monotonic() < deadline, f"announcement of version {version} not seen (newest {puller.newest})"


def publish_versions(trainer, pub, versions):
    """Train one step per version, publish it and wait until it is announced (no coalescing)."""
    snaps = {}
    for v in versions:
        if v:
            trainer.step()
        snaps[v] = trainer.snapshot()
        pub.publish(trainer.model.state_dict(), v)
        assert pub.wait(60)
    return snaps


def test_publish_does_not_wait_for_slow_store(run, tmp_path):
    # The store holds every upload until the test lets it go: each publish returns while no upload can end, so
    # the step pays only the host copy, however slow the machine (a publish that waited for its upload would hang
    # at the gate, which the test opens only after the last publish)
    bus, names = run
    store = HeldStore((tmp_path / "weights").as_uri(), names.run)
    trainer = Trainer()
    pub = Publisher(store, bus, names, "solver")
    trainer.step()
    pub.publish(trainer.model.state_dict(), 1)
    assert store.entered.wait(60), "version 1's upload did not start"  # the worker holds version 1 at the gate
    for v in range(2, 7):
        trainer.step()
        pub.publish(trainer.model.state_dict(), v)
    assert not pub.announcements and not pub.errors  # every publish returned with version 1 still uploading
    store.gate.set()
    assert pub.wait(60)
    pub.close()
    # uploads slower than steps: versions 2-5, each replaced by the next while version 1 uploaded, are coalesced
    versions = [a.version for a in pub.announcements]
    assert versions == [1, 6] and not pub.errors, (versions, pub.errors)
    assert pub.announcements[0].kind == "full" and pub.announcements[0].reason == "first version"


def test_puller_five_behind_catches_up_through_the_chain(run, tmp_path):
    bus, names = run
    store = WeightStore((tmp_path / "weights").as_uri(), names.run)
    trainer = Trainer()
    pub = Publisher(store, bus, names, "solver")
    snaps = publish_versions(trainer, pub, [0])
    updates = []
    puller = Puller(store, bus, names, "solver", on_update=lambda state, v: updates.append(v))
    wait_newest(puller, 0)
    assert puller.sync() and puller.version == 0
    snaps |= publish_versions(trainer, pub, range(1, 6))
    pub.close()
    assert [a.kind for a in pub.announcements] == ["full"] + ["delta"] * 5
    assert all(0.5 < a.sparsity < 1 for a in pub.announcements[1:])
    wait_newest(puller, 5)
    steps = puller.plan(5)
    assert [(s.kind, s.base, s.version) for s in steps] == [("delta", v - 1, v) for v in range(1, 6)]
    assert puller.sync()
    assert updates == [0, 5] and puller.sha256 == pub.announcements[-1].sha256
    assert_bit_equal(puller.state, snaps[5])
    # a fresh puller starts from the full snapshot, then the deltas
    fresh = Puller(store, None, names, "solver")
    assert [s.kind for s in fresh.plan(5)] == ["full"] + ["delta"] * 5
    fresh.sync(5)
    assert_bit_equal(fresh.state, snaps[5])
    puller.close()


def test_dense_float32_updates_back_off_from_delta_attempts(run, tmp_path):
    """Every weight changes each version (full float32 training): deltas are tried at versions 1, 2, 4 and 8
    only, every version is a full snapshot, and a puller still lands on the newest one bit-exactly."""
    bus, names = run
    store = WeightStore((tmp_path / "weights").as_uri(), names.run)
    gen = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(4096, generator=gen)}
    pub = Publisher(store, bus, names, "solver")
    for v in range(10):
        state["w"] += torch.randn(4096, generator=gen)  # random steps: a constant one codes as a small delta
        pub.publish(state, v)
        assert pub.wait(60)
    pub.close()
    assert [a.kind for a in pub.announcements] == ["full"] * 10 and not pub.errors
    tried = [a.version for a in pub.announcements if "not sparse enough" in a.reason]
    skipped = [a.version for a in pub.announcements if "deltas tried were over" in a.reason]
    assert tried == [1, 2, 4, 8] and skipped == [3, 5, 6, 7, 9]
    puller = Puller(store, bus, names, "solver")
    wait_newest(puller, 9)
    assert puller.sync() and puller.version == 9
    assert_bit_equal(puller.state, state)
    assert list(puller.announced) == [9]  # older announcements are forgotten once loaded


def test_corrupt_delta_is_refetched_then_replaced_by_a_full_snapshot(run, tmp_path, caplog):
    bus, names = run
    store = WeightStore((tmp_path / "weights").as_uri(), names.run)
    trainer = Trainer()
    pub = Publisher(store, bus, names, "solver", max_chain=2)  # full snapshot every third version
    snaps = publish_versions(trainer, pub, range(6))
    pub.close()
    assert [a.kind for a in pub.announcements] == ["full", "delta", "delta", "full", "delta", "delta"]
    assert "periodic full" in pub.announcements[3].reason
    puller = Puller(store, None, names, "solver", state=snaps[0], version=0)
    path = Path(tmp_path / "weights" / store.key("solver", 2, "delta"))
    data = bytearray(path.read_bytes())
    data[-8] ^= 0x10
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="weights.puller"):
        assert puller.sync(5)
    text = caplog.text
    assert "00000002/delta.zst is corrupt" in text and "refetching" in text and "falling back" in text
    assert_bit_equal(puller.state, snaps[5])


def test_missing_object_clear_error_retry_and_old_weights_kept(run, tmp_path, caplog):
    bus, names = run
    uri = (tmp_path / "weights").as_uri()
    trainer = Trainer()
    pub = Publisher(WeightStore(uri, names.run), bus, names, "solver")
    snaps = publish_versions(trainer, pub, range(4))
    pub.close()
    store = StaleListingStore(uri, names.run)
    updates = []
    puller = Puller(store, None, names, "solver", state={k: v.clone() for k, v in snaps[2].items()}, version=2,
                    on_update=lambda state, v: updates.append(v), attempts=3, backoff_s=0.01)
    assert [s.version for s in puller.plan(3)] == [3]  # the listing is taken now, then the object disappears
    key = store.key("solver", 3, "delta")
    target = tmp_path / "weights" / key
    saved = target.read_bytes()
    target.unlink()
    with caplog.at_level(logging.DEBUG, logger="weights"):
        with pytest.raises(WeightsUnavailable, match="no stored chain reaches version 3"):
            puller.sync(3)
    # each retry at debug level, naming the object; the outcome once, as a warning
    retried = [r for r in caplog.records if "; retrying in" in r.getMessage()]
    retries = [r.getMessage() for r in retried]
    assert len(retries) == 2 and all(r.levelno == logging.DEBUG for r in retried), retries
    assert retries[0].startswith(f"puller solver: fetching {key}: attempt 1 failed (weight object "), retries
    assert "00000003/delta.zst is missing after 3 attempts" in caplog.text
    assert puller.version == 2 and updates == []
    assert_bit_equal(puller.state, snaps[2])
    # the object comes back (e.g. a late upload): a retry with a fresh listing succeeds from the kept weights
    target.write_bytes(saved)
    again = Puller(WeightStore(uri, names.run), None, names, "solver", state=puller.state, version=puller.version,
                   on_update=lambda state, v: updates.append(v))
    assert again.sync(3) and updates == [3]
    assert_bit_equal(again.state, snaps[3])


def test_publish_and_pull_through_s3(run, s3_uri):
    bus, names = run
    uri, options = s3_uri
    store = WeightStore(uri, names.run, **options)
    trainer = Trainer()
    pub = Publisher(store, bus, names, "solver", keep_versions=2)
    snaps = publish_versions(trainer, pub, range(4))
    pub.close()
    assert pub.announcements[-1].uri.startswith(f"{uri}/{names.run}/solver/00000003/")
    puller = Puller(WeightStore(uri, names.run, **options), bus, names, "solver")
    wait_newest(puller, 3)
    assert puller.sync()
    assert_bit_equal(puller.state, snaps[3])
    puller.close()


def test_s3_credentials_come_from_an_aws_profile(run, s3_uri, tmp_path, monkeypatch):
    """No keys in options or the environment: the named profile of the shared credentials file signs."""
    bus, names = run
    uri, options = s3_uri
    shared = tmp_path / "credentials"
    shared.write_text("[astraflow-test]\naws_access_key_id = profilekey\naws_secret_access_key = profilesecret\n")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(shared))
    monkeypatch.setenv("AWS_PROFILE", "astraflow-test")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    store = WeightStore(uri, names.run, endpoint=options["endpoint"], region=options["region"])
    store.put(names.run + "/solver/probe", b"signed by the profile")
    assert store.get(names.run + "/solver/probe") == b"signed by the profile"


def test_a_ghost_announcement_is_not_a_target(run, tmp_path, caplog):
    # Version 1000 is announced but its object never appears (a crash between announce and upload,
    # a foreign writer): pullers go to the newest version that is in the store, and say so once.
    from topics.codec import encode, headers_for
    from topics.schemas import WeightAnnouncement

    bus, names = run
    uri = (tmp_path / "weights").as_uri()
    trainer = Trainer()
    pub = Publisher(WeightStore(uri, names.run), bus, names, "solver")
    snaps = publish_versions(trainer, pub, range(3))
    pub.close()
    ghost = WeightAnnouncement(policy="solver", version=1000, kind="full", uri=f"{uri}/nowhere", bytes=1,
                               sha256="0" * 64, sparsity=0.0)
    producer = bus.producer()
    producer.send(names.weights, encode(ghost), key="solver", headers=headers_for(ghost))
    producer.flush()
    puller = Puller(WeightStore(uri, names.run), bus, names, "solver")
    wait_newest(puller, 1000)
    with caplog.at_level(logging.WARNING):
        assert puller.newest_durable() == 2 and puller.newest_durable(ttl_s=0.0) == 2
    assert caplog.text.count("version 1000 is announced but not in the store") == 1
    assert puller.sync(puller.newest_durable()) and puller.version == 2
    assert_bit_equal(puller.state, snaps[2])
    producer.close()
    puller.close()


def test_a_store_deleted_mid_run_is_reported_and_the_next_version_is_full(run, tmp_path, caplog):
    bus, names = run
    root = tmp_path / "weights"
    store = WeightStore(root.as_uri(), names.run)
    trainer = Trainer()
    pub = Publisher(store, bus, names, "solver")
    publish_versions(trainer, pub, range(3))
    assert [a.kind for a in pub.announcements] == ["full", "delta", "delta"] and pub.store_lost == 0
    shutil.rmtree(root)  # someone deletes the bucket's contents while the run goes on
    with caplog.at_level(logging.ERROR, logger="weights"):
        snaps = publish_versions(trainer, pub, [3, 4])
    pub.close()
    lost = pub.announcements[3]
    assert (lost.kind, pub.announcements[4].kind) == ("full", "delta"), pub.announcements
    assert lost.reason.startswith("the store lost ") and lost.reason.endswith("00000000/full.safetensors, where the "
                                                                               "delta chain starts"), lost.reason
    assert pub.store_lost == 1 and pub.last_publish["store_lost_total"] == 1.0
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "no longer holds" in errors[0] and "version 3 is published full" in errors[0], errors
    # a worker that joins now starts from the new full snapshot
    fresh = Puller(WeightStore(root.as_uri(), names.run), None, names, "solver")
    assert [(s.kind, s.version) for s in fresh.plan(4)] == [("full", 3), ("delta", 4)]
    fresh.sync(4)
    assert_bit_equal(fresh.state, snaps[4])

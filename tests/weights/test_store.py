"""The weight store on a local directory and on a real S3-compatible server."""
import threading

import pytest

from weights.store import ObjectExists, ObjectMissing, StoreError, WeightStore


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return WeightStore((tmp_path / "weights").as_uri(), "run")
    uri, options = request.getfixturevalue("s3_uri")
    return WeightStore(uri, "run", **options)


def test_put_get_list_and_missing(store, tmp_path):
    store.put(store.key("solver", 2, "delta"), b"delta-2")
    src = tmp_path / "f.bin"
    src.write_bytes(b"F" * 1000)
    store.put(store.key("solver", 1, "full"), src)
    store.put(store.key("verifier", 1, "full"), b"other policy")
    assert store.get(store.key("solver", 2, "delta")) == b"delta-2"
    assert store.get(store.key("solver", 1, "full"), start=10, length=4) == b"FFFF"
    versions = store.versions("solver")
    assert {v: {k: o.size for k, o in objs.items()} for v, objs in versions.items()} == {1: {"full": 1000}, 2: {"delta": 7}}
    assert store.uri_of(versions[2]["delta"].key).endswith("/run/solver/00000002/delta.zst")
    with pytest.raises(ObjectMissing, match="00000009/full.safetensors does not exist"):
        store.get(store.key("solver", 9, "full"))
    dst = tmp_path / "down.bin"
    assert store.download(store.key("solver", 1, "full"), dst) == 1000 and dst.read_bytes() == src.read_bytes()
    whole = tmp_path / "whole.bin"  # a size known from the listing: read whole, written at once
    assert store.download(store.key("solver", 1, "full"), whole, size=1000) == 1000
    assert whole.read_bytes() == src.read_bytes()
    with pytest.raises(ObjectMissing, match="00000009/full.safetensors does not exist"):
        store.download(store.key("solver", 9, "full"), whole, size=1000)


def test_retention_keeps_what_live_chains_need(store):
    # versions 0..9; full snapshots at 0, 4 and 8; deltas at 1..9
    for v in range(10):
        if v % 4 == 0:
            store.put(store.key("p", v, "full"), b"full")
        if v:
            store.put(store.key("p", v, "delta"), b"delta")
    # keep 3 newest (7, 8, 9): newest full <= 7 is 4, so 4..9 stay
    before = store.versions("p")
    deleted = store.retain("p", keep=3)
    assert sorted(deleted) == sorted(o.key for v, objs in before.items() if v < 4 for o in objs.values())
    assert sorted(store.versions("p")) == [4, 5, 6, 7, 8, 9]
    assert store.retain("p", keep=10) == []


def test_bad_uri():
    with pytest.raises(StoreError, match="must be file"):
        WeightStore("ftp://x/y", "run")
    with pytest.raises(StoreError, match="absolute"):
        WeightStore("file://relative/dir", "run")


def test_local_put_is_atomic_for_concurrent_readers(tmp_path):
    """A reader polling while a writer creates large objects only ever sees a whole object, or none."""
    store = WeightStore((tmp_path / "weights").as_uri(), "run")
    keys = [store.key("p", v, "full") for v in range(1, 7)]
    payloads = [bytes([v]) * (4 << 20) for v in range(1, 7)]
    seen, stop = [], threading.Event()

    def read():
        while not stop.is_set():
            for key, payload in zip(keys, payloads):
                try:
                    seen.append(store.get(key) == payload)
                except ObjectMissing:
                    pass

    reader = threading.Thread(target=read)
    reader.start()
    for key, payload in zip(keys, payloads):
        store.put(key, payload)
    stop.set()
    reader.join()
    assert seen, "the reader never saw an object"
    assert all(seen)
    # staging files are not listed as objects
    assert [o.key for o in store.objects("p")] == keys


def test_an_http_endpoint_from_the_environment_works(s3_uri, monkeypatch):
    # The MinIO setup of docs/guides/scaling-out.md: everything from AWS_* variables, the endpoint plain http on loopback.
    uri, options = s3_uri
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret_access_key"])
    monkeypatch.setenv("AWS_REGION", options["region"])
    monkeypatch.delenv("AWS_ALLOW_HTTP", raising=False)
    store = WeightStore(uri, "envrun")
    store.put(store.key("actor", 1, "full"), b"weights")
    assert store.get(store.key("actor", 1, "full")) == b"weights"
    assert list(store.versions("actor")) == [1]


def test_an_object_is_never_overwritten_with_other_bytes(store, tmp_path):
    key = store.key("p", 3, "full")
    store.put(key, b"weights of version 3")
    store.put(key, b"weights of version 3")  # a retried put whose first attempt landed: accepted
    src = tmp_path / "same.bin"
    src.write_bytes(b"weights of version 3")
    store.put(key, src)
    with pytest.raises(ObjectExists, match="00000003/full.safetensors refused: an object with other bytes"):
        store.put(key, b"other weights, same version")
    src.write_bytes(b"other weights from a file")
    with pytest.raises(ObjectExists):
        store.put(key, src)
    assert store.get(key) == b"weights of version 3"

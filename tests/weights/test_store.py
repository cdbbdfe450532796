"""The weight store on a local directory and on a real S3-compatible server."""
import threading

import pytest

from weights.store import ObjectMissing, StoreError, WeightStore


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return WeightStore(WeightStore.default_uri(tmp_path), "run")
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
    assert store.key_of(store.uri_of("run/solver/00000002/delta.zst")) == "run/solver/00000002/delta.zst"
    with pytest.raises(ObjectMissing, match="00000009/full.safetensors does not exist"):
        store.get(store.key("solver", 9, "full"))
    dst = tmp_path / "down.bin"
    assert store.download(store.key("solver", 1, "full"), dst) == 1000 and dst.read_bytes() == src.read_bytes()


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
    """A reader polling while a writer replaces a large object only ever sees a whole version."""
    store = WeightStore(WeightStore.default_uri(tmp_path), "run")
    key = store.key("p", 1, "full")
    payloads = [bytes([i]) * (4 << 20) for i in range(6)]
    seen, stop = [], threading.Event()

    def read():
        while not stop.is_set():
            try:
                seen.append(store.get(key))
            except ObjectMissing:
                pass

    reader = threading.Thread(target=read)
    reader.start()
    for p in payloads:
        store.put(key, p)
    stop.set()
    reader.join()
    assert seen, "the reader never saw the object"
    assert all(s in payloads for s in seen)
    # staging files are not listed as objects
    assert [o.key for o in store.objects("p")] == [key]


def test_an_http_endpoint_from_the_environment_works(s3_uri, monkeypatch):
    # The README's MinIO setup: everything from AWS_* variables, the endpoint plain http on loopback.
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

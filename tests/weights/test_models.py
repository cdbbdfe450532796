"""Resolving a config's ``model``: models built from a script are built once per version of the script and its
inputs, into the cache, under a file lock; paths must be HF model directories."""
import hashlib
import json
import threading

import pytest

from weights import models
from weights.models import BUILT_MODELS, TINY_SCRIPT, BuiltModel, built_model_dir, resolve_model

BUILDER = '''
import json, time
from pathlib import Path

def build(out_dir):
    out = Path(out_dir)
    out.mkdir(parents=True)
    time.sleep(0.2)  # long enough for a second caller to wait on the lock
    log = Path(__file__).with_name("builds.log")
    log.write_text(log.read_text() + "x" if log.exists() else "x")
    (out / "config.json").write_text(json.dumps({"data": Path(__file__).with_name("data.txt").read_text()}))
'''


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A built model ``fake`` whose script counts its builds in ``builds.log`` and copies ``data.txt`` (its
    input) into config.json; the cache is ``tmp_path/cache``."""
    script, data = tmp_path / "make_fake.py", tmp_path / "data.txt"
    script.write_text(BUILDER)
    data.write_text("one")
    monkeypatch.setenv("ASTRAFLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(BUILT_MODELS, "fake", BuiltModel("fake-model", script, "build", (data,)))
    return tmp_path


def test_the_tiny_models_cache_key_is_still_the_scripts_sha256():
    """Existing caches of ``tiny`` stay valid: its digest is the sha256 of make_tiny_model.py alone."""
    assert BUILT_MODELS["tiny"].digest() == hashlib.sha256(TINY_SCRIPT.read_bytes()).hexdigest()[:12]
    search = BUILT_MODELS["tiny-search"]
    assert search.script.name == "make_tiny_search_model.py" and search.builder == "make_tiny_search_model"
    assert {p.name for p in search.inputs} == {"make_tiny_model.py", "search_kb.jsonl"}


def test_a_built_model_is_built_once_by_concurrent_callers_and_again_when_an_input_changes(fake):
    results = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model("fake"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = results[0]
    assert results == [first] * 3 and (fake / "builds.log").read_text() == "x"
    assert first.name == f"fake-model-{BUILT_MODELS['fake'].digest()}" and first.parent == fake / "cache"
    assert json.loads((first / "config.json").read_text()) == {"data": "one"}
    assert not [p for p in (fake / "cache").iterdir() if ".tmp-" in p.name]
    (fake / "data.txt").write_text("two")
    second = built_model_dir("fake")
    assert second != first and json.loads((second / "config.json").read_text()) == {"data": "two"}
    assert (fake / "builds.log").read_text() == "xx"


def test_unknown_names_missing_scripts_and_non_model_paths_are_refused(fake, tmp_path):
    with pytest.raises(KeyError, match="no built model named 'nope'"):
        built_model_dir("nope")
    (fake / "data.txt").unlink()
    with pytest.raises(FileNotFoundError, match="data.txt is missing: the fake model is built from a source"):
        built_model_dir("fake")
    with pytest.raises(FileNotFoundError, match="is not an HF model directory"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path
    assert models.tiny_model_dir.__doc__ and models.tiny_search_model_dir.__doc__

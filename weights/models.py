"""Resolving a config's ``model`` field to an HF model directory.

Three names are models built here, from a script, with no download (:data:`BUILT_MODELS`):

- ``tiny``: the tiny arithmetic model (``scripts/make_tiny_model.py``, a ~300k-parameter Qwen2 with a
  character tokenizer), about 15 s on 2 cores;
- ``tiny-search``: the same architecture pre-trained on search episodes over
  ``producers/data/search_kb.jsonl`` (``scripts/make_tiny_search_model.py``), about 40 s on 2 cores;
- ``tiny-search-hermes``: the search model with a chat template that calls its tool in the hermes format
  (``<tool_call>`` JSON, ``tool`` turns; ``scripts/make_tiny_hermes_model.py``), the caller TRL's tool loop needs.

Each is built on first use and cached under ``$ASTRAFLOW_CACHE`` (default ``~/.cache/astraflow``) as
``<prefix>-<digest>``, the digest being the first 12 hex digits of the sha256 of the script (followed by the
files it reads: for ``tiny-search`` ``make_tiny_model.py`` and the knowledge base, for ``tiny-search-hermes``
``make_tiny_search_model.py`` too), so a changed script
builds anew; a file lock lets concurrent processes share one build.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY_SCRIPT = ROOT / "scripts" / "make_tiny_model.py"
TINY_SEARCH_SCRIPT = ROOT / "scripts" / "make_tiny_search_model.py"
TINY_HERMES_SCRIPT = ROOT / "scripts" / "make_tiny_hermes_model.py"
SEARCH_KB = ROOT / "producers" / "data" / "search_kb.jsonl"


@dataclass(frozen=True)
class BuiltModel:
    """A model built from a script in this checkout.

    Attributes:
        prefix: the cache directory's name before ``-<digest>``.
        script: the build script; it defines ``builder(out_dir)``, which writes an HF model directory.
        builder: the name of that function.
        inputs: other files the build depends on; their bytes are part of the digest.
    """

    prefix: str
    script: Path
    builder: str
    inputs: tuple[Path, ...] = ()

    def digest(self) -> str:
        """The first 12 hex digits of the sha256 of the script's bytes followed by each input's."""
        h = hashlib.sha256(self.script.read_bytes())
        for path in self.inputs:
            h.update(path.read_bytes())
        return h.hexdigest()[:12]


BUILT_MODELS: dict[str, BuiltModel] = {
    "tiny": BuiltModel("tiny-model", TINY_SCRIPT, "make_tiny_model"),
    "tiny-search": BuiltModel("tiny-search-model", TINY_SEARCH_SCRIPT, "make_tiny_search_model",
                              (TINY_SCRIPT, SEARCH_KB)),
    "tiny-search-hermes": BuiltModel("tiny-search-hermes-model", TINY_HERMES_SCRIPT, "make_tiny_hermes_model",
                                     (TINY_SCRIPT, TINY_SEARCH_SCRIPT, SEARCH_KB)),
}
"""Model names built from scripts (:func:`built_model_dir`), by the name a config's ``model`` uses."""


def cache_dir() -> Path:
    """The AstraFlow cache directory (``$ASTRAFLOW_CACHE`` or ``~/.cache/astraflow``), created if needed."""
    path = Path(os.environ.get("ASTRAFLOW_CACHE", Path.home() / ".cache" / "astraflow"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def built_model_dir(name: str) -> Path:
    """The directory of built model ``name`` (a key of :data:`BUILT_MODELS`), building it once per version
    of its script and inputs (under a file lock, into a temporary directory renamed into place).

    Raises:
        KeyError: ``name`` is not a built model.
        FileNotFoundError: the script or an input is missing (AstraFlow not installed from a checkout).
    """
    if name not in BUILT_MODELS:
        raise KeyError(f"no built model named {name!r} (known: {', '.join(BUILT_MODELS)})")
    spec = BUILT_MODELS[name]
    for path in (spec.script, *spec.inputs):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the {name} model is built from a source checkout")
    digest = spec.digest()
    cache = cache_dir()
    target = cache / f"{spec.prefix}-{digest}"
    with open(cache / f"{spec.prefix}-{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            module_spec = importlib.util.spec_from_file_location(spec.script.stem, spec.script)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            tmp = cache / f"{spec.prefix}-{digest}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            getattr(module, spec.builder)(tmp)
            os.replace(tmp, target)
    return target


def tiny_model_dir() -> Path:
    """The tiny arithmetic model's directory (:func:`built_model_dir` of ``tiny``).

    Raises:
        FileNotFoundError: the script is missing (AstraFlow not installed from a checkout).
    """
    return built_model_dir("tiny")


def tiny_search_model_dir() -> Path:
    """The tiny search model's directory (:func:`built_model_dir` of ``tiny-search``).

    Raises:
        FileNotFoundError: the script or the knowledge base is missing (AstraFlow not installed from a checkout).
    """
    return built_model_dir("tiny-search")


def resolve_model(spec: str) -> Path:
    """The model directory for a config's ``model`` value: a name in :data:`BUILT_MODELS` (``tiny``,
    ``tiny-search``, ``tiny-search-hermes``) or a path.

    Raises:
        FileNotFoundError: the path is not a directory holding ``config.json``.
    """
    if spec in BUILT_MODELS:
        return built_model_dir(spec)
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model {spec!r}: {path} is not an HF model directory (no config.json)")
    return path

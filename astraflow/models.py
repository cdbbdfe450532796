"""Resolving a config's ``model`` field to an HF model directory.

``tiny`` names the built-in tiny arithmetic model (``scripts/make_tiny_model.py``,
a ~300k-parameter Qwen2 with a character tokenizer). It is built on first use
(about 15 s on 2 cores, no download) and cached under ``$ASTRAFLOW_CACHE``
(default ``~/.cache/astraflow``) as ``tiny-model-<sha256 of the script>``; a
file lock lets concurrent processes share one build.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

TINY_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_tiny_model.py"


def cache_dir() -> Path:
    """The AstraFlow cache directory (``$ASTRAFLOW_CACHE`` or ``~/.cache/astraflow``), created if needed."""
    path = Path(os.environ.get("ASTRAFLOW_CACHE", Path.home() / ".cache" / "astraflow"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def tiny_model_dir() -> Path:
    """The tiny model's directory, building it once per version of the script.

    Raises:
        FileNotFoundError: the script is missing (AstraFlow not installed from a checkout).
    """
    if not TINY_SCRIPT.is_file():
        raise FileNotFoundError(f"{TINY_SCRIPT} is missing: the tiny model is built from a source checkout")
    digest = hashlib.sha256(TINY_SCRIPT.read_bytes()).hexdigest()[:12]
    cache = cache_dir()
    target = cache / f"tiny-model-{digest}"
    with open(cache / f"tiny-model-{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            spec = importlib.util.spec_from_file_location("make_tiny_model", TINY_SCRIPT)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            tmp = cache / f"tiny-model-{digest}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            module.make_tiny_model(tmp)
            os.replace(tmp, target)
    return target


def resolve_model(spec: str) -> Path:
    """The model directory for a config's ``model`` value: ``tiny`` or a path.

    Raises:
        FileNotFoundError: the path is not a directory holding ``config.json``.
    """
    if spec == "tiny":
        return tiny_model_dir()
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model {spec!r}: {path} is not an HF model directory (no config.json)")
    return path

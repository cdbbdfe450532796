"""The packages' imports point one way: ``topics`` <- ``weights``, ``policies`` <- ``producers``, ``consumers``,
``trainer`` <- ``astraflow`` <- ``scripts``, and no cycle between two packages of one layer.

Every ``import`` and ``from ... import`` statement counts, wherever it is: at module level, inside a function, under
``if TYPE_CHECKING:``. Read with :mod:`ast`, so nothing is imported.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: each package's layer; a package may import its own layer's packages (without a cycle) and those below
LAYERS = {"topics": 0, "weights": 1, "policies": 1, "producers": 2, "consumers": 2, "trainer": 2, "astraflow": 3,
          "scripts": 4}


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """``(line, top-level package)`` of every absolute import in ``path`` of one of :data:`LAYERS`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        out += [(node.lineno, n.split(".")[0]) for n in names if n.split(".")[0] in LAYERS]
    return out


def package_imports(root: Path) -> dict[tuple[str, str], list[str]]:
    """``{(importing package, imported package): ["path:line", ...]}`` over every module of :data:`LAYERS`
    under ``root``, an import of one's own package left out."""
    edges: dict[tuple[str, str], list[str]] = {}
    for package in LAYERS:
        for path in sorted((root / package).rglob("*.py")):
            for line, imported in imported_packages(path):
                if imported != package:
                    edges.setdefault((package, imported), []).append(f"{path.relative_to(root)}:{line}")
    return edges


def layer_violations(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    """One line per import that runs up a layer, and per cycle between packages of one layer."""
    bad = [f"{where}: {src} (layer {LAYERS[src]}) imports {dst} (layer {LAYERS[dst]})"
           for (src, dst), sites in sorted(edges.items()) if LAYERS[dst] > LAYERS[src] for where in sites]
    same = {(s, d) for s, d in edges if LAYERS[s] == LAYERS[d]}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(d == goal or (d not in seen and reaches(d, goal, seen | {d})) for s, d in same if s == start)

    for src, dst in sorted(same):
        if reaches(dst, src, {dst}):
            bad.append(f"{edges[(src, dst)][0]}: {src} imports {dst}, and {dst} imports {src} (directly or through "
                       "others of its layer): a cycle")
    return bad


def test_the_tree_imports_down_the_layers_only():
    assert layer_violations(package_imports(ROOT)) == []


@pytest.mark.parametrize("files, expected", [
    ({"topics/a.py": "def f():\n    from astraflow.config import RunConfig\n"},
     ["topics/a.py:2: topics (layer 0) imports astraflow (layer 3)"]),
    ({"producers/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import astraflow.config\n"},
     ["producers/a.py:3: producers (layer 2) imports astraflow (layer 3)"]),
    ({"trainer/a.py": "from consumers.serving import ServingStage\n",
      "consumers/b.py": "import trainer.loop\n"},
     ["consumers/b.py:1: consumers imports trainer, and trainer imports consumers (directly or through others of "
      "its layer): a cycle",
      "trainer/a.py:1: trainer imports consumers, and consumers imports trainer (directly or through others of "
      "its layer): a cycle"]),
    ({"astraflow/a.py": "from trainer.loop import Trainer\nfrom . import b\n", "trainer/b.py": "import topics.bus\n",
      "consumers/c.py": "from producers.engines import Engine\n"}, []),
])
def test_an_import_up_a_layer_or_closing_a_cycle_is_named(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert layer_violations(package_imports(tmp_path)) == expected

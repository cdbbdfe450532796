"""The README is a landing page: at most 250 lines, every example config in its examples table; every local link
of the README and of the pages under docs/ resolves; the documentation site (mkdocs.yml) builds with
``mkdocs build --strict`` without a warning. The code blocks of the README and the docs hold: each YAML block is a
valid run config once laid over an example, each Python block compiles (and runs, where it imports what it uses),
and each shell block marked ``<!-- runnable -->`` runs, its ``astraflow run`` commands cut to 2 steps."""
import copy
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^(<!-- runnable -->\n)?```(\w+)[^\n]*\n(.*?)^```$", re.M | re.S)
#: the example a YAML block of the docs is laid over (it has a tool, a workflow with options and every section)
BASE_CONFIG = ROOT / "examples" / "search-tiny.yaml"


def code_blocks(lang: str, runnable_only: bool = False) -> list[tuple[str, str]]:
    """``(page:line, body)`` of every fenced block in ``lang`` of the README and the docs."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(2) == lang and (m.group(1) or not runnable_only):
                where = f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
                found.append((where, m.group(3)))
    return found


def laid_over(base: dict, fragment: dict) -> dict:
    """``base`` with ``fragment``'s keys set into it, mappings merged key by key."""
    for key, value in fragment.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            laid_over(base[key], value)
        else:
            base[key] = value
    return base


def test_the_readme_is_a_landing_page_of_at_most_250_lines():
    assert len(README.splitlines()) <= 250


def test_every_example_is_in_the_examples_table():
    examples = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "examples").rglob("*.yaml"))
    rows = [line for line in README.splitlines() if line.startswith("| `examples/")]
    listed = {m for line in rows for m in re.findall(r"`(examples/[^`]+\.yaml)`", line)}
    assert [e for e in examples if e not in listed] == []


def test_every_local_link_resolves():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert local and [link for link in local if not (ROOT / link).exists()] == []


def test_every_local_link_of_the_docs_resolves():
    broken = []
    for page in (ROOT / "docs").rglob("*.md"):
        for link in re.findall(r"\]\(([^)#]+)\)", page.read_text()):
            if not link.startswith(("http://", "https://")) and not (page.parent / link).exists():
                broken.append(f"{page.relative_to(ROOT)}: {link}")
    assert broken == []


def test_the_site_builds_without_a_warning(tmp_path):
    """Every page is in the nav, every link and anchor resolves, every API page's module documents cleanly."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "WARNING" not in output, output
    assert (tmp_path / "site" / "reference" / "metrics" / "index.html").is_file()


@pytest.mark.parametrize("where,body", code_blocks("yaml"), ids=lambda x: x.partition("\n")[0][:60])
def test_every_yaml_block_is_a_valid_run_config(where, body, monkeypatch, tmp_path):
    from astraflow.config import RunConfig

    if "sasl_password: from ASTRAFLOW_KAFKA_SASL_PASSWORD" in body:  # the Kafka guide's secret, as it says
        monkeypatch.setenv("ASTRAFLOW_KAFKA_SASL_PASSWORD", "from-the-environment")
    fragment = yaml.safe_load(body)
    assert isinstance(fragment, dict), where
    if "ssl_ca_location" in fragment.get("kafka", {}):  # a file of the reader's: it must exist
        (tmp_path / "ca.pem").write_text("")
        fragment["kafka"]["ssl_ca_location"] = str(tmp_path / "ca.pem")
    RunConfig.model_validate(laid_over(copy.deepcopy(yaml.safe_load(BASE_CONFIG.read_text())), fragment))


@pytest.mark.parametrize("where,body", code_blocks("python"), ids=lambda x: x.partition("\n")[0][:60])
def test_every_python_block_compiles_and_the_self_contained_ones_run(where, body):
    code = compile(body, where, "exec")
    if body.startswith(("from ", "import ")):  # it imports what it uses: run it, and build its environment
        script = body + "\nif 'load_environment' in globals() and 'Environment' in globals():\n    load_environment()\n"
        proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{where}: {proc.stderr[-2000:]}"
    assert code is not None


def test_some_shell_blocks_are_marked_runnable():
    assert len(code_blocks("bash", runnable_only=True)) >= 1


@pytest.mark.parametrize("where,body", code_blocks("bash", runnable_only=True), ids=lambda x: x.partition("\n")[0][:60])
def test_every_runnable_shell_block_runs(where, body, tmp_path):
    """Each line runs from the repository's root; ``astraflow run`` and ``status`` see one temporary run directory,
    and a run trains 2 steps (the later of two overrides of one field wins)."""
    for line in body.strip().splitlines():
        argv = shlex.split(line, comments=True)
        if argv[:2] in ([".venv/bin/astraflow", "run"], [".venv/bin/astraflow", "status"]):
            argv.append(f"run_dir={tmp_path / 'run'}")
        if argv[:2] == [".venv/bin/astraflow", "run"]:
            argv.append("policies.actor.steps=2")
        argv[0] = str(ROOT / argv[0]) if argv[0].startswith(".venv/") else argv[0]
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, f"{where}: {line}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"

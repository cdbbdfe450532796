"""The README is a landing page: at most 250 lines, every example config in its examples table; every local link
of the README and of the pages under docs/ resolves; the documentation site (mkdocs.yml) builds with
``mkdocs build --strict`` without a warning."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


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

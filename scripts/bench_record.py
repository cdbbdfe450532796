#!/usr/bin/env python3
"""Run a benchmark and commit its result: its last JSON line, with where it ran, becomes
``docs/benchmarks/data/NAME.json``, from which ``scripts/gen_reference.py`` renders its table.

    scripts/bench_record.py NAME [--conditions TEXT] -- scripts/bench_X.py [ARGS...]

The bench runs with this interpreter from the repository's root, its output passed through as it comes. The
recorded object is the bench's last line (a JSON object) plus ``command`` (the bench and its arguments),
``commit`` (``git rev-parse --short HEAD``; the bench ran on it only if the tree was clean: ``dirty`` says when
not), ``machine`` (platform and usable CPUs) and ``conditions`` (free text: the load, the broker, anything a
reader needs to weigh the figures). Exits with the bench's code when it failed, 3 when its last line is not a
JSON object (nothing is written then), else 0.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "benchmarks" / "data"


def git_commit() -> str | None:
    """``git rev-parse --short HEAD`` of the repository, or None outside a git checkout."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def tree_is_dirty() -> bool:
    """Whether tracked files differ from HEAD (``git status --porcelain --untracked-files=no`` prints anything)."""
    done = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                          text=True, timeout=30)
    return bool(done.stdout.strip())


def machine() -> str:
    """The platform and the CPUs this process may use (``nproc``)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{platform.platform()}, nproc {cpus}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 usage="%(prog)s NAME [--conditions TEXT] -- scripts/bench_X.py [ARGS...]")
    ap.add_argument("name", help="the result's file name under docs/benchmarks/data, without .json")
    ap.add_argument("--conditions", default=None, help="what a reader needs to weigh the figures (load, broker...)")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args, bench = ap.parse_args(argv[:split]), argv[split + 1:]
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", args.name):
        ap.error(f"NAME {args.name!r}: letters, digits, '-' and '_' only (a file name under docs/benchmarks/data)")
    if not bench or not bench[0].startswith("scripts/bench_"):
        ap.error("give the bench after --, e.g. -- scripts/bench_async.py --quick")
    commit, dirty = git_commit(), tree_is_dirty()
    last = ""
    with subprocess.Popen([sys.executable, *bench], cwd=ROOT, stdout=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if line.strip():
                last = line.strip()
    if proc.returncode != 0:
        print(f"bench_record: {' '.join(bench)} exited {proc.returncode}: nothing recorded", file=sys.stderr)
        return proc.returncode
    try:
        result = json.loads(last)
    except json.JSONDecodeError:
        result = None
    if not isinstance(result, dict):
        print(f"bench_record: the last line of {' '.join(bench)} is not a JSON object: {last[:200]!r}",
              file=sys.stderr)
        return 3
    result.update(command=bench, commit=commit, machine=machine())
    if dirty:
        result["dirty"] = True
    if args.conditions:
        result["conditions"] = args.conditions
    out = DATA / f"{args.name}.json"
    out.write_text(json.dumps(result, indent=4) + "\n")
    print(f"bench_record: wrote {out.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

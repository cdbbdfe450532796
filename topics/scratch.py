"""Scratch directories in the system temp dir that no dead process leaves behind: a weight snapshot staged on
its way to or from the store, a sandbox run's private directory.

A :class:`ScratchDir` is named ``astraflow-scratch-<kind>-<random>`` and its owner holds an exclusive
:func:`fcntl.flock` on it for as long as it exists. The kernel drops the lock when the owner dies, however it
dies, so a directory of that name whose lock nobody holds was left by a killed process:
:func:`sweep_scratch`, run as each component starts, removes those. The lock, unlike a pid in the name, holds
across pid reuse and across PID namespaces that share one temp dir.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

#: The start of every scratch directory's name (nothing else in the temp dir is ever swept).
SCRATCH_PREFIX = "astraflow-scratch-"


def remove_tree(root: Path) -> None:
    """Delete the directory ``root`` and everything under it, even subdirectories made unreadable (symlinks are
    not followed); what cannot be deleted (another user's files) is left, silently."""
    shutil.rmtree(root, ignore_errors=True)
    if root.exists():
        for dirpath, dirnames, _ in os.walk(root):
            for d in dirnames:
                try:
                    os.chmod(os.path.join(dirpath, d), 0o700, follow_symlinks=False)
                except OSError:
                    pass
        shutil.rmtree(root, ignore_errors=True)


def _open_dir(path: Path) -> int:
    """A read-only descriptor of the directory ``path`` itself (never a symlink's target)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)


class ScratchDir:
    """A new private directory in the system temp dir (``tempfile.gettempdir()``), locked by this process until
    :meth:`remove`; a context manager yielding its path and removing it on exit.

    Args:
        kind: what it holds, a name part (``full``, ``pull``, ``sandbox``).

    Attributes:
        path: the directory (mode 0700, as :func:`tempfile.mkdtemp` makes it).

    Raises:
        OSError: the directory cannot be made or opened.
    """

    def __init__(self, kind: str) -> None:
        while True:
            path = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{kind}-"))
            fd = _open_dir(path)
            fcntl.flock(fd, fcntl.LOCK_EX)  # a sweep holding it briefly (it found the directory unlocked) is waited
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # that sweep removed it before this process locked it: make another
        self.path, self._fd = path, fd

    def remove(self) -> None:
        """Delete the directory and what it holds, then release its lock (a second call does nothing)."""
        if self._fd is None:
            return
        try:
            remove_tree(self.path)
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc: object) -> None:
        self.remove()


def sweep_scratch(directory: str | Path | None = None) -> list[Path]:
    """Remove the scratch directories (:class:`ScratchDir`) in ``directory`` whose owner process is gone: those
    whose lock this call can take. A live owner's directory, and anything in ``directory`` not named
    ``astraflow-scratch-*`` or not a directory, is kept.

    Args:
        directory: where to look; None: the system temp dir (``tempfile.gettempdir()``).

    Returns:
        The directories removed. One this process may not open or remove (another user's) is skipped.
    """
    root = Path(directory) if directory is not None else Path(tempfile.gettempdir())
    removed = []
    try:
        entries = [e for e in os.scandir(root) if e.name.startswith(SCRATCH_PREFIX)]
    except FileNotFoundError:
        return removed
    for entry in entries:
        path = Path(entry.path)
        try:
            fd = _open_dir(path)
        except OSError:  # removed since the listing, not a directory, a symlink, or not this user's to open
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # BlockingIOError: its owner lives
                continue
            remove_tree(path)
            if not path.exists():
                removed.append(path)
        finally:
            os.close(fd)
    return removed

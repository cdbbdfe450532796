"""A component keeps the memory it frees (:func:`astraflow.launched.keep_freed_memory`): a block of a train step's
size comes from malloc's heap, not a mapping of its own that ``free`` unmaps, and stays in the heap once freed;
an operator's ``GLIBC_TUNABLES`` for malloc stands. Fresh interpreters (malloc's settings are per process and
apply to what is allocated after them); glibc's own figures (``mallinfo2``)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ALLOCATE = """
import ctypes, json, sys
from astraflow.launched import keep_freed_memory

class MallInfo2(ctypes.Structure):  # malloc.h: arena (heap bytes from sbrk), hblkhd (bytes in mapped blocks), ...
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
block = bytearray(16 << 20)
alive = mallinfo2()
del block
freed = mallinfo2()
print(json.dumps({"applied": applied, "mapped_alive": alive.hblkhd, "heap_freed": freed.arena}))
"""
MIB = 1 << 20


def allocate(mode: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", ALLOCATE, mode], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT), **env), check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_freed_block_stays_in_the_heap_for_the_next_step():
    default, kept = allocate("default"), allocate("keep")
    # glibc's default: a 16 MiB block is a mapping of its own (over the 128 KiB threshold), unmapped when freed,
    # so that the next step maps it and faults its pages in again
    assert default["mapped_alive"] >= 16 * MIB, default
    assert kept["applied"] is True
    assert kept["mapped_alive"] < 16 * MIB, kept  # from the heap
    assert kept["heap_freed"] >= 16 * MIB, kept  # and kept there once freed


def test_an_operators_glibc_tunables_for_malloc_stand():
    assert allocate("keep", GLIBC_TUNABLES="glibc.malloc.trim_threshold=0")["applied"] is False

"""The launcher's malloc setting: a freed step-sized buffer stays in the process's heap for the
next one instead of going back to the OS (a fresh process each, Linux/glibc only)."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

PROBE = """
import ctypes, sys
import megatron_pg_agg.training  # what a launcher imports first (megatron-core with it)
from megatron_pg_agg.training.worker_process import keep_freed_memory
if sys.argv[1] == "keep":
    keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.sbrk.restype, libc.sbrk.argtypes = [ctypes.c_void_p], ctypes.c_void_p, [ctypes.c_long]
n = 256 << 20  # a planning buffer of 32M int64 positions
p = libc.malloc(n)
top = libc.sbrk(0)
in_heap = p < top  # served from the heap (brk), not from its own mmap
libc.free(p)
print(int(in_heap), top - libc.sbrk(0))  # and how much the heap shrank when it was freed
"""


def _probe(mode: str) -> tuple:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    in_heap, shrunk = out.stdout.split()[-2:]
    return bool(int(in_heap)), int(shrunk)


def test_a_freed_buffer_stays_in_the_heap():
    # glibc's default: a buffer this size is mapped on its own and unmapped when freed
    assert _probe("default") == (False, 0)
    in_heap, shrunk = _probe("keep")
    # kept: from the heap, which does not shrink when it is freed (a trim threshold truncated to 0
    # gives it back at once: shrunk ~ 256 MiB)
    assert in_heap and shrunk == 0, (in_heap, shrunk)

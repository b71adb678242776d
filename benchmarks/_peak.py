"""Peak-memory measurement shared by the benchmarks: the extra resident-set high-water mark of one
call, in a fresh child process, with freed memory returned to the OS and the kernel's mark reset
first (Linux: /proc/self/clear_refs 5), so earlier work in the process cannot hide or inflate it."""
from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def extra_peak_bytes(run) -> int:
    """Run ``run()`` (inputs already built) and return the bytes its peak adds to the resident set."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _rss("VmRSS")
    run()
    return _rss("VmHWM") - base


def in_child(module: str, function: str, *args) -> int:
    """``module.function(*args)`` (which returns an int) in a fresh interpreter; benchmarks/ on the path."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import {module} as m; print(m.{function}(*{args!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])

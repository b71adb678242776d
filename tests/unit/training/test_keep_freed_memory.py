"""The launcher's malloc setting keeps a freed step-sized buffer for the next one: counted in the
page faults of a second allocation (a fresh process each, Linux/glibc only)."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

PROBE = """
import resource, sys
import torch
if sys.argv[1] == "keep":
    from megatron_pg_agg.training.worker_process import keep_freed_memory
    keep_freed_memory()
n = 64 << 20  # 64 MiB: a planning buffer of 8M int64 positions
torch.empty(n, dtype=torch.uint8).fill_(1)  # allocated, touched, freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(n, dtype=torch.uint8).fill_(1)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_a_freed_buffer_is_reused_without_page_faults():
    pages = (64 << 20) // 4096
    default = _faults("default")
    kept = _faults("keep")
    # glibc's default maps a buffer this size afresh: every page faults again
    assert default > pages // 2, default
    # kept: the second buffer reuses the first's memory (a trim threshold truncated to 0 fails here)
    assert kept < pages // 16, (kept, default)

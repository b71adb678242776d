"""Megatron-core's real pipeline schedules, DDP and finalize_model_grads run on CPU with gloo.

Launches ``torchrun --standalone --nproc_per_node 4 tests/dist/smoke_worker.py`` (4 layouts in
one launch: TP2xPP2, DP2xPP2, DP4, PP2 interleaved x DP2) and checks it reports every layout.
A smoke test only: finite, non-zero gradients; exact parity is checked elsewhere.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist" / "smoke_worker.py"
TIMEOUT_S = 120  # a normal run takes ~15 s on 2 cores; the worker dumps stacks on a hang at 75 s
EXPECTED = [
    "TP2xPP2xCP1xDP1 ok",
    "TP1xPP2xCP1xDP2 ok",
    "TP1xPP1xCP1xDP4 ok",
    "TP1xPP2(vpp=2)xCP1xDP2 ok",
    "SMOKE OK",
]


def _launch() -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           str(WORKER)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    t0 = time.monotonic()
    # own session: on a timeout the whole launch (torchrun and its 4 workers) is killed
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {TIMEOUT_S}s; output:\n{out[-20000:]}")
    return proc.returncode, out, time.monotonic() - t0


def test_schedules_run_on_cpu_gloo_for_four_layouts():
    rc, out, elapsed = _launch()
    missing = [line for line in EXPECTED if line not in out]
    if rc != 0 or missing:
        pytest.fail(f"smoke worker failed (rc={rc}, missing {missing}); output:\n{out[-20000:]}")
    print(f"smoke launch took {elapsed:.1f}s")

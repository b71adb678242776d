"""Megatron-core's real pipeline schedules, DDP and finalize_model_grads run on CPU with gloo.

Launches ``torchrun --standalone --nproc_per_node 4 -m tests.distributed.workers.smoke_worker`` (4 layouts in
one launch: TP2xPP2, DP2xPP2, DP4, PP2 interleaved x DP2) and checks it reports every layout.
A smoke test only: finite, non-zero gradients; exact parity is checked elsewhere.
"""
from __future__ import annotations

import pytest

from tests.support.launching import run, torchrun, worker

WORKER = worker("smoke_worker")
TIMEOUT_S = 120  # a normal run takes ~15 s on 2 cores; the worker dumps stacks on a hang at 75 s
EXPECTED = [
    "TP2xPP2xCP1xDP1 ok",
    "TP1xPP2xCP1xDP2 ok",
    "TP1xPP1xCP1xDP4 ok",
    "TP1xPP2(vpp=2)xCP1xDP2 ok",
    "SMOKE OK",
]


def test_schedules_run_on_cpu_gloo_for_four_layouts():
    rc, out, elapsed = run(torchrun(4, *WORKER), TIMEOUT_S, "smoke torchrun")
    missing = [line for line in EXPECTED if line not in out]
    if rc != 0 or missing:
        pytest.fail(f"smoke worker failed (rc={rc}, missing {missing}); output:\n{out[-20000:]}")
    print(f"smoke launch took {elapsed:.1f}s")

"""What the slime and miles plug-in tests share: the host checkout and Megatron-LM paths, the launches.

Each host's distributed test (tests/distributed/test_slime.py, test_miles.py) launches its worker once
per world size (1 rank: DP 1 x CP 1; 2 ranks: DP 2 x CP 1, then DP 1 x CP 2) and reads every case's row.
"""
from __future__ import annotations

import json
import os

from tests.support.launching import child_env, run, torchrun, worker
from tests.support.optional import REQUIRE_MEGATRON_LM, require

THIRD_PARTY = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "third_party")
LAYOUTS = ("dp1cp1", "dp2cp1", "dp1cp2")
MODES = ("token_mean", "seq_mean", "prompt_mean", "constant")
SPLITS = ("static1", "static3", "dynamic")
"""The workers' micro-batch splits: static --micro-batch-size 1 and 3, dynamic (a 30-token cap)."""
GBS = 6
"""The workers' --global-batch-size: 2 optimizer steps of 6 rollouts."""


def checkout_paths(env: str, problem, require_env: str) -> tuple[str, str]:
    """``(host checkout, Megatron-LM checkout)``: the host's from ``env`` (``problem(path)`` says why
    not), Megatron-LM's from ``MEGATRON_LM_PATH`` or ``../shared/third_party/Megatron-LM``; skips
    without them, or fails under ``require_env=1``."""
    host = os.environ.get(env)
    require(problem(host), require_env)
    megatron_lm = os.environ.get("MEGATRON_LM_PATH") or os.path.join(THIRD_PARTY, "Megatron-LM")
    if not os.path.isdir(os.path.join(megatron_lm, "megatron", "training")):
        require(f"no Megatron-LM checkout at {megatron_lm} (MEGATRON_LM_PATH)",
                require_env if os.environ.get(require_env) == "1" else REQUIRE_MEGATRON_LM)
    return os.path.abspath(host), os.path.abspath(megatron_lm)


def launch_layouts(tmp, name: str, env: str, host: str, megatron_lm: str) -> dict:
    """``{layout: {case: row}}`` from the worker ``{name}_worker``, one launch per world size, with the
    host's checkout in ``env``."""
    child = child_env(**{env: host, "MEGATRON_LM_PATH": megatron_lm})
    out = {}
    for world in (1, 2):
        path = tmp / f"world{world}.json"
        rc, log, elapsed = run(torchrun(world, *worker(f"{name}_worker"), path), 600, f"{name} world {world}",
                               env=child)
        assert rc == 0, log[-20000:]
        data = json.loads(path.read_text())
        print(f"{name} world {world}: {len(data['cases'])} cases in {elapsed:.1f}s")
        for key, case in data["cases"].items():
            layout, case_name = key.split("/")
            out.setdefault(layout, {})[case_name] = case
    assert sorted(out) == sorted(LAYOUTS)
    return out


def stock_token_mean_moves(results: dict, splits, clean_ok) -> list:
    """The stock ``--calculate-per-token-loss`` control of both hosts (no plug-in): on the rollout
    without a fully masked sample every step passes ``clean_ok(step)``; with one per step (k = 1), J
    and the gradient are the reference's times N / (N + k) (clamp_min(mask sum, 1) counts it as a
    token). Returns each step's relative shift 1 - N / (N + k)."""
    moved = []
    for layout, cases in results.items():
        for split in splits:
            for step in cases[f"stock-token_mean-clean-{split}"]["steps"]:
                assert clean_ok(step), (layout, split, step)
            for step in cases[f"stock-token_mean-{split}"]["steps"]:
                n, k = step["valid_tokens"], step["fully_masked"]
                assert k == 1, step
                factor = n / (n + k)
                assert abs(step["objective"] - factor * step["reference"]) <= 1e-6 * abs(step["reference"]), step
                assert abs(step["grad_error"] - (1 - factor)) <= 1e-5, step
                moved.append(1 - factor)
    return moved

"""Multi-token prediction in the trainer (launch/train_actor.py) across layouts: one rank with 4
microbatches, DP=2 and TP=2 give the same first step in every mode: objective, gradient norm
(MTP parameters included) and the mtp_loss pair. (PP=2 initialises each stage from its own seed,
so its fresh weights differ; PP=2 with the MTP block on the last stage is compared from a common
checkpoint through Megatron-LM's loop, tests/distributed/test_megatron_lm.py.)

The MTP gradient itself is checked against Megatron's own token-mean run, and the unpatched
strength against its predicted factor, in tests/unit/megatron/test_mtp.py; here the question is
whether anything of it depends on the layout (a per-rank or per-microbatch count, a report pair
counted once per TP rank, a pipeline stage whose MTP loss never reaches the report).
"""
from __future__ import annotations

import json

import pytest

from megatron_pg_agg.core.modes import MODES
from megatron_pg_agg.versions import in_range, installed_megatron_core_version
from tests.support.launching import run, torchrun, worker
from tests.support.records import first_step

RUNS = worker("trainer_runs")
LAYOUTS = {
    "1x4mb": (1, ["--num-microbatches", "4"]),
    "DP2": (2, []),
    "TP2": (2, ["--tensor-model-parallel-size", "2"]),
}
MTP = ["--rollouts", "synthetic", "--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3", "--train-iters", "1",
       "--pg-kl-coef", "0.05", "--pg-entropy-coef", "0.01"]
pytestmark = pytest.mark.skipif(not in_range(installed_megatron_core_version(), ">=0.16"),
                                reason="megatron-core 0.15 refuses MTP (tests/unit/megatron/test_mtp_checks.py)")


def _mode_flags(mode: str) -> list:
    return ["--pg-loss-aggregation", mode, *(["--pg-loss-aggregation-divisor", "32"] if mode == "constant" else [])]


@pytest.fixture(scope="module")
def layout_records(tmp_path_factory) -> dict:
    """{(layout, mode): the first step's record}, every mode of a layout in one launch."""
    tmp = tmp_path_factory.mktemp("mtp")
    records = {}
    for layout, (nproc, flags) in LAYOUTS.items():
        runs = [{"name": mode, "argv": [*MTP, *flags, *_mode_flags(mode),
                                        "--metrics-file", str(tmp / f"{layout}-{mode}.jsonl")]} for mode in MODES]
        spec, status = tmp / f"{layout}.runs.json", tmp / f"{layout}.status.json"
        spec.write_text(json.dumps(runs))
        rc, out, _ = run(torchrun(nproc, *RUNS, spec, status), 600, f"MTP runs {layout}")
        assert rc == 0 and json.loads(status.read_text()) == {m: 0 for m in MODES}, out[-20000:]
        for mode in MODES:
            records[layout, mode] = first_step(tmp / f"{layout}-{mode}.jsonl")
    return records


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def test_every_layout_gives_the_same_first_step_with_mtp(layout_records):
    """Objective and grad norm to 1e-6, the mtp_loss pair's count exactly (the step's D) and its
    value to 1e-6, in every mode and layout, against one rank with 4 microbatches."""
    worst = {}
    for mode in MODES:
        base = layout_records["1x4mb", mode]
        total, count = base["mtp_loss"]
        assert count == base["valid_tokens"] > 0 and total > 0
        for layout in LAYOUTS:
            got = layout_records[layout, mode]
            assert got["weight"] == base["weight"] and got["mtp_loss"][1] == count, (layout, mode)
            for key, value in (("objective", got["objective"]), ("grad_norm", got["grad_norm"]),
                               ("mtp_loss", got["mtp_loss"][0] / got["mtp_loss"][1])):
                ref = base[key] if key != "mtp_loss" else total / count
                worst[key] = max(worst.get(key, 0.0), _rel(value, ref))
                assert _rel(value, ref) <= 1e-6, (layout, mode, key, value, ref)
    print("worst relative difference to 1 rank x 4 microbatches:", {k: f"{v:.1e}" for k, v in worst.items()})


def test_the_mtp_loss_is_the_same_in_every_mode(layout_records):
    """The MTP term does not depend on the mode (its normaliser is D, not W): the same mtp_loss
    pair in token_mean, seq_mean, prompt_mean and constant, while their weights differ."""
    pairs = {mode: layout_records["DP2", mode]["mtp_loss"] for mode in MODES}
    weights = {mode: layout_records["DP2", mode]["weight"] for mode in MODES}
    assert len(set(weights.values())) >= 3, weights
    first = pairs["token_mean"]
    for mode, pair in pairs.items():
        assert pair[1] == first[1] and _rel(pair[0], first[0]) <= 1e-6, (mode, pair, first)


def test_the_mtp_roll_under_context_parallelism_stays_in_each_padded_slot(tmp_path):
    """CP=2 on the loss side (the MTP block itself needs GPTModel, whose THD attention under CP
    needs Transformer Engine): megatron-core's own roll of the labels and of the denominator mask
    on the CP group, under the mtp_loss patch, equals a whole-sequence roll within each padded
    slot, cut into the planner's CP chunks (written in the worker, the gathered tokens checked
    against the rollouts), and the rolled mask's count summed over the CP ranks is the
    reference's. As released, megatron-core rolls on the real lengths divided by CP and does not
    (the control). Catches the patch's padded boundaries dropped, or applied only without CP."""
    out = tmp_path / "cp_roll.json"
    rc, log, _ = run(torchrun(2, *worker("mtp_cp_roll_worker"), out), 300, "MTP roll under CP=2")
    assert rc == 0, log[-20000:]
    result = json.loads(out.read_text())
    assert result["tokens_ok"] and result["padding"], result  # the layout is as assumed; padding exists
    assert result["patched"]["agree"], result
    assert result["patched"]["count"] == result["patched_expected_count"] > 0, result
    assert not result["released"]["agree"], result

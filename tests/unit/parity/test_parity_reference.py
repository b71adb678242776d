"""Host-only checks of the parity harness: the built-in step really splits groups and
microbatches, the independent reference agrees with the library's loss path on a logits table for
every (mode, policy loss), the docs/parity.md table comparison catches a changed cell, and the
command refuses bad selections before launching anything."""
import json

import pytest

from megatron_pg_agg.data.planner import PlanConfig, plan_step
from megatron_pg_agg.parity import DEFAULT_CASES, MODES, POLICY_LOSSES, loss_config, markdown_table, parity_rollouts
from tests.support.parity_tables import table_mismatches


def test_the_parity_step_really_splits_groups_and_has_unequal_microbatches():
    rollouts = parity_rollouts()
    plan = plan_step(rollouts, loss_config("prompt_mean"), PlanConfig(dp_size=2, num_microbatches=3))
    where = {}
    for rank, mbs in enumerate(plan.microbatches):
        for m, mb in enumerate(mbs):
            for s in mb.sequence_ids:
                where.setdefault(rollouts[s].group_id, set()).add((rank, m))
    assert any(len({r for r, _ in v}) > 1 for v in where.values()), "no group spans two DP ranks"
    assert any(len({m for r, m in v if r == rank}) > 1 for v in where.values() for rank in (0, 1)), \
        "no group spans two microbatches of one DP rank"
    counts = [int(mb.token_weights.count.sum()) for mbs in plan.microbatches for mb in mbs]
    tokens = [t for row in plan.bin_tokens for t in row]
    assert len(set(counts)) > 1 and len(set(tokens)) > 1
    # one response has no valid token and some tokens are filtered from the numerator only
    assert any(sum(r.loss_mask) == 0 for r in rollouts)
    assert any(n < m for r in rollouts for n, m in zip(r.numerator_mask, r.loss_mask))


def _library_objective(forward_logits, rollouts, cfg):
    """The same step through the package's own loss path (policy_token_losses with a one-sequence
    SequenceStatistic, kl_penalty and ONE local-form ``aggregate`` call): the form the parity
    reference used to share with the layouts."""
    import torch

    from megatron_pg_agg.core.aggregation import aggregate
    from megatron_pg_agg.core.losses import SequenceStatistic, kl_penalty, policy_token_losses

    first_seen = {}
    for r in rollouts:
        first_seen.setdefault(r.group_id, len(first_seen))
    order = sorted(range(len(rollouts)), key=lambda i: (first_seen[rollouts[i].group_id], i))
    group_sizes = []
    for k, i in enumerate(order):
        if k and rollouts[i].group_id == rollouts[order[k - 1]].group_id:
            group_sizes[-1] += 1
        else:
            group_sizes.append(1)
    width = max(len(r.response_ids) for r in rollouts)
    num = torch.zeros(len(rollouts), width, dtype=torch.bool)
    den = torch.zeros(len(rollouts), width, dtype=torch.bool)
    pg_rows, kl_rows, ent_rows = [], [], []
    for row, i in enumerate(order):
        r = rollouts[i]
        p, n = len(r.prompt_ids), len(r.response_ids)
        logp_all = torch.log_softmax(forward_logits(list(r.prompt_ids) + list(r.response_ids))[p - 1:p + n - 1], -1)
        logp = logp_all.gather(-1, torch.tensor(list(r.response_ids))[:, None])[:, 0]
        d = torch.tensor(list(r.loss_mask), dtype=torch.bool)
        nm = d & torch.tensor(list(r.numerator_mask), dtype=torch.bool)
        pad = (0, width - n)
        sequence = SequenceStatistic(torch.tensor([0, n]), nm.sum().reshape(1).float(), n)
        pg, _, _ = policy_token_losses(logp, torch.where(d, torch.tensor(r.old_logprobs), 0.0),
                                       torch.where(d, torch.tensor(r.advantages), 0.0), nm, cfg, sequence)
        pg_rows.append(torch.nn.functional.pad(pg, pad))
        kl = kl_penalty(logp, torch.where(d, torch.tensor(r.ref_logprobs), 0.0), cfg.kl_estimator)
        kl_rows.append(torch.nn.functional.pad(kl, pad))
        ent_rows.append(torch.nn.functional.pad(-(logp_all.exp() * logp_all).sum(-1), pad))
        num[row, :n], den[row, :n] = nm, d
    j_pg, weight = aggregate(torch.stack(pg_rows), num, denominator_mask=den, mode=cfg.mode,
                             divisor=cfg.divisor, group_sizes=group_sizes)
    valid = int(den.sum())
    if int(weight) == 0:
        return j_pg
    return (j_pg + cfg.kl_coef * torch.where(den, torch.stack(kl_rows), 0.0).sum() / valid
            - cfg.entropy_coef * torch.where(den, torch.stack(ent_rows), 0.0).sum() / valid)


@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
@pytest.mark.parametrize("mode", MODES)
def test_the_independent_reference_agrees_with_the_library_without_a_model(mode, policy_loss):
    """Host only: ``parity.step_objective`` (float64 Python sums from the README) and the
    package's loss path give the same objective and gradient on the parity step, with logits from
    a fixed random table instead of a model (dual clip, KL, entropy, a response with no valid
    token and filtered tokens all in play); and both give J = 0 with zero gradient when W = 0."""
    import dataclasses

    import torch

    from megatron_pg_agg.parity import VOCAB, step_objective

    rollouts = parity_rollouts()
    cfg = loss_config(mode, policy_loss)
    table = (torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(3)) * 2).requires_grad_(True)

    def forward_logits(ids):
        return table[torch.tensor(ids)]

    ours, weight = step_objective(forward_logits, rollouts, cfg)
    (g_ours,) = torch.autograd.grad(ours, table)
    lib = _library_objective(forward_logits, rollouts, cfg)
    (g_lib,) = torch.autograd.grad(lib, table)
    assert weight > 0
    assert abs(float(ours) - float(lib)) <= 1e-6 * abs(float(ours)), (float(ours), float(lib))
    assert float((g_ours - g_lib).abs().max()) <= 1e-5 * float(g_ours.abs().max())
    empty = [dataclasses.replace(r, loss_mask=[0] * len(r.loss_mask), numerator_mask=[0] * len(r.loss_mask))
             for r in rollouts]
    zero, w0 = step_objective(forward_logits, empty, cfg)
    assert w0 == 0 and float(zero) == 0.0 and not zero.requires_grad


@pytest.mark.parametrize("argv, message", [
    (["--policy-losses", "ppo,grpo"], "'ppo,grpo': choose from ppo, gspo, gmpo, cispo"),
    (["--modes", "seq_mean,mean"], "choose from token_mean, seq_mean, prompt_mean, constant"),
    (["--layouts", "no such layout"], "no layout matches"),
])
def test_the_parity_command_refuses_bad_selections_before_launching(argv, message, capsys):
    from megatron_pg_agg.parity import main

    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_controls_run_only_where_they_must_change_the_result():
    """The GSPO control runs gspo under seq_mean only; a layout runs every selected pair."""
    control = next(c for c in DEFAULT_CASES if c.control == "no_cp_statistic_reduction")
    assert control.cp == 2 and control.runs(MODES, POLICY_LOSSES) == [("gspo", "seq_mean")]
    assert control.runs(["token_mean"], POLICY_LOSSES) == []
    layout = next(c for c in DEFAULT_CASES if not c.expect_fail)
    assert layout.runs(["seq_mean"], ["gmpo", "ppo"]) == [("gmpo", "seq_mean"), ("ppo", "seq_mean")]


def _rows_from_docs():
    """JSON-like rows rebuilt from docs/parity.md's table (only what markdown_table prints)."""
    from megatron_pg_agg.parity import find_markdown_table
    from tests.support.launching import ROOT
    from tests.support.parity_tables import _cells

    text = (ROOT / "docs" / "parity.md").read_text()
    start, end = find_markdown_table(text)
    table = text[start:end]
    rows = []
    for (layout, policy, mode), cell in _cells(table).items():
        if cell == "-":
            continue
        row = {"layout": layout, "policy_loss": policy, "mode": mode, "expect_fail": "as it must" in cell,
               "passed": "FAIL" not in cell and "control broken" not in cell}
        if cell.startswith("J = "):
            row.update(objective=float(cell[4:]), objective_rel_err=0.0, grad_max_rel_err=0.0)
        else:
            obj, grad = cell.split(" ")[0], cell.split(" ")[2]
            row.update(objective=0.0, objective_rel_err=float(obj), grad_max_rel_err=float(grad))
        rows.append(row)
    return table, rows


def test_the_docs_table_check_catches_a_changed_cell_and_a_missing_row():
    """table_mismatches is what tests/distributed/test_parity.py trusts: the docs' own table passes
    against rows rebuilt from it and against the same rows with float-noise changes (every error
    halved or doubled inside its tolerance, a reference J moved by 1e-7), and fails when an error
    leaves its tolerance, a reference moves by 1e-4, a verdict flips, or a row disappears."""
    table, rows = _rows_from_docs()
    assert len(rows) > 200 and {r["policy_loss"] for r in rows} == set(POLICY_LOSSES)
    assert table_mismatches(table, rows) == []
    noise = json.loads(json.dumps(rows))
    for r in noise:
        if r["layout"].startswith("single"):
            r["objective"] *= 1 + 1e-7
        elif not r["expect_fail"]:
            r["objective_rel_err"] = min(r["objective_rel_err"] * 2.0, 0.9e-6)
            r["grad_max_rel_err"] = r["grad_max_rel_err"] / 2.0
    assert table_mismatches(table, noise) == []  # another machine's noise
    moved = json.loads(json.dumps(rows))
    target = next(r for r in moved if not r["layout"].startswith("single") and not r["expect_fail"])
    target["grad_max_rel_err"] = 2e-5  # outside GRAD_RTOL, but still marked passed
    assert any(target["layout"] in p for p in table_mismatches(table, moved))
    shifted = json.loads(json.dumps(rows))
    next(r for r in shifted if r["layout"].startswith("single"))["objective"] *= 1 + 1e-4
    assert any("reference" in p for p in table_mismatches(table, shifted))
    flipped = json.loads(json.dumps(rows))
    next(r for r in flipped if r["expect_fail"])["passed"] = False
    assert table_mismatches(table, flipped)
    missing = [r for r in rows if r["policy_loss"] != "gmpo"]
    assert table_mismatches(table, missing)
    assert markdown_table(rows) == table  # the rebuild is exact, so the checks above are meaningful

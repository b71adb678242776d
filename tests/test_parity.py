"""The parity suite: the real megatron-core schedules, DDP and finalize_model_grads under several
layouts (torchrun, gloo, CPU) against a single-process reference, for every mode and policy loss.

One run of the parity command (two torchrun launches: 2 and 4 ranks) covers DP=2, TP=2, PP=2
(1F1B), PP=2 interleaved, 1/3/8 microbatches, DP=2 x PP=2, TP=2 x PP=2, TP=2 x DP=2, CP=2 x DP=2
(per-token model), the MoE layouts, each with ppo, gspo, gmpo and cispo, and four negative controls
that must FAIL parity (one: GSPO's sequence statistic without the CP all-reduce). The
reference (``parity.step_objective``) shares no code with the package's loss or aggregation, so a
bug common to the library's two forms fails every row. The README's table must be what this run
prints (benchmarks/parity_table.py writes it).
"""
import json
import re
import subprocess
import sys

import pytest

from megatron_pg_agg.parity import (DEFAULT_CASES, GRAD_RTOL, MODES, OBJECTIVE_RTOL, POLICY_LOSSES,
                                    find_markdown_table, loss_config, markdown_table, parity_rollouts)
from megatron_pg_agg.planner import PlanConfig, plan_step

from launching import ROOT, child_env


@pytest.fixture(scope="module")
def parity_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    out, png = tmp / "rows.json", tmp / "errors.png"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_pg_agg.parity", "--json", str(out), "--plot", str(png),
         "--timeout", "600"],
        cwd=ROOT, capture_output=True, text=True, timeout=1300, env=child_env(),
    )
    return proc, out, png


def test_every_layout_and_mode_matches_the_reference(parity_run):
    proc, out, _ = parity_run
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-20000:]
    rows = json.loads(out.read_text())
    checked = [r for r in rows if not r["layout"].startswith("single") and not r["expect_fail"]]
    expected = {(case.name, p, m) for case in DEFAULT_CASES if not case.expect_fail
                for p in POLICY_LOSSES for m in MODES}
    assert {(r["layout"], r["policy_loss"], r["mode"]) for r in checked} == expected
    for r in checked:
        assert r["objective_rel_err"] <= OBJECTIVE_RTOL, r
        assert r["grad_max_rel_err"] <= GRAD_RTOL, r
        assert r["passed"]
    # the summary line exactly (a substring match would accept "10 failed")
    assert proc.stdout.rstrip().splitlines()[-1] == f"{len(rows)} passed, 0 failed", proc.stdout[-3000:]


def test_negative_controls_fail_parity(parity_run):
    """Megatron's default averaging with unequal microbatches, weights computed per microbatch
    (prompt_mean across microbatches; seq_mean across CP shards) and GSPO's sequence ratio from
    each CP rank's own tokens (no CP all-reduce) must be caught."""
    proc, out, _ = parity_run
    rows = json.loads(out.read_text())
    controls = [r for r in rows if r["expect_fail"]]
    assert {(r["layout"], r["policy_loss"]) for r in controls} == {
        (case.name, p) for case in DEFAULT_CASES if case.expect_fail for p in case.control_policy_losses}
    assert ("gspo", 2) in {(r["policy_loss"], c.cp) for r in controls for c in DEFAULT_CASES if c.name == r["layout"]}
    for r in controls:
        assert r["grad_max_rel_err"] > 100 * GRAD_RTOL, r  # far outside the tolerance, not noise
        assert r["passed"]  # "passed" for a control means: parity failed, as it must


def test_plot_is_written(parity_run):
    _, _, png = parity_run
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
    counts = [int(mb.weights.count.sum()) for mbs in plan.microbatches for mb in mbs]
    tokens = [t for row in plan.bin_tokens for t in row]
    assert len(set(counts)) > 1 and len(set(tokens)) > 1
    # one response has no valid token and some tokens are filtered from the numerator only
    assert any(sum(r.loss_mask) == 0 for r in rollouts)
    assert any(n < m for r in rollouts for n, m in zip(r.numerator_mask, r.loss_mask))


def _cells(table: str) -> dict:
    """{(layout, policy loss, mode): cell text} of a markdown parity table (header and rule
    skipped)."""
    out = {}
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for mode, cell in zip(MODES, cells[2:]):
            out[(cells[0], cells[1], mode)] = cell
    return out


_NUMBER = re.compile(r"-?\d+\.(\d+)(?:e([-+]\d+))?")


def table_mismatches(readme_table: str, rows) -> list:
    """Where a README parity table disagrees with the suite's JSON rows: layouts and their order,
    which modes ran, the verdict markers, and every number beyond one unit of its last printed
    digit (so run-to-run noise at a rounding boundary passes, any real change does not)."""
    fresh = markdown_table(rows)
    problems = []
    names = lambda table: [tuple(c.strip() for c in line.split("|")[1:3])  # noqa: E731
                           for line in table.strip().splitlines()[2:]]
    if names(readme_table) != names(fresh):
        problems.append(f"layouts differ: README {names(readme_table)} vs suite {names(fresh)}")
    want, got = _cells(readme_table), _cells(fresh)
    for key in sorted(set(want) & set(got)):
        a, b = want[key], got[key]
        if _NUMBER.sub("#", a) != _NUMBER.sub("#", b):
            problems.append(f"{key}: README {a!r} vs suite {b!r}")
            continue
        for x, y in zip(_NUMBER.finditer(a), _NUMBER.finditer(b)):
            unit = 10.0 ** (-len(x.group(1)) + int(x.group(2) or 0))
            if abs(float(x.group(0)) - float(y.group(0))) > unit * 1.01:
                problems.append(f"{key}: README {a!r} vs suite {b!r}")
                break
    return problems


def test_readme_parity_table_is_what_the_suite_prints(parity_run):
    """README.md's table (written by benchmarks/parity_table.py from --json) against this run."""
    _, out, _ = parity_run
    rows = json.loads(out.read_text())
    text = (ROOT / "README.md").read_text()
    start, end = find_markdown_table(text)
    problems = table_mismatches(text[start:end], rows)
    assert not problems, "README parity table is stale (python benchmarks/parity_table.py parity.json " \
                         "--readme README.md):\n" + "\n".join(problems)


def _library_objective(forward_logits, rollouts, cfg):
    """The same step through the package's own loss path (policy_token_losses with a one-sequence
    SequenceStatistic, kl_penalty and ONE local-form ``aggregate`` call): the form the parity
    reference used to share with the layouts."""
    import torch

    from megatron_pg_agg.aggregation import aggregate
    from megatron_pg_agg.losses import SequenceStatistic, kl_penalty, policy_token_losses

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
    j_pg, weight = aggregate(torch.stack(pg_rows), num, denominator_mask=den, mode=cfg.canonical_mode,
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

"""How parity rows are shown: the console table, docs/parity.md's markdown table and the error plot.

A row (what ``--json`` writes) is a dict: ``layout``, ``policy_loss``, ``mode``, ``objective``,
``reference``, ``objective_rel_err``, ``grad_max_rel_err``, ``expect_fail`` (a negative control)
and ``passed`` (for a control: parity failed, as it must)."""
from __future__ import annotations

from .fixture import DEFAULT_CASES, GRAD_RTOL, MODES, POLICY_LOSSES

__all__ = ["REFERENCE_LABELS", "TABLE_HEADER", "find_markdown_table", "format_row", "markdown_table",
           "plot_errors", "print_table"]

REFERENCE_LABELS = {"gpt": "", "per_token": " (per-token model)", "moe": " (MoE model)", "mtp": " (MTP model)"}
"""Suffix of the reference rows' layout label per model kind."""
TABLE_HEADER = "| layout | policy loss | " + " | ".join(MODES) + " |"


def format_row(row) -> str:
    verdict = "pass" if row["passed"] else "FAIL"
    if row["expect_fail"]:
        verdict += " (control: must differ)"
    return (f"{row['layout']:<62} {row['policy_loss']:<6} {row['mode']:<12} {row['objective']:>+12.7f} "
            f"{row['objective_rel_err']:>10.2e} {row['grad_max_rel_err']:>10.2e}  {verdict}")


def print_table(rows) -> None:
    print(f"{'layout':<62} {'policy':<6} {'mode':<12} {'objective':>12} {'obj relerr':>10} "
          f"{'grad relerr':>10}  result")
    for row in rows:
        print(format_row(row))


def _table_cell(row) -> str:
    if row["layout"].startswith("single-process reference"):
        return f"J = {row['objective']:.7f}"
    cell = f"{row['objective_rel_err']:.1e} / {row['grad_max_rel_err']:.1e}"
    if row["expect_fail"]:
        cell += " **fails, as it must**" if row["passed"] else " **did not fail: control broken**"
    elif not row["passed"]:
        cell += " **FAIL**"
    return cell


def markdown_table(rows) -> str:
    """docs/parity.md's parity table from the rows ``--json`` writes: one line per (layout, policy
    loss), cells ``J = ...`` (references) or ``objective rel err / max grad rel err`` per mode,
    ``-`` where a mode did not run. Grouped by model (GPT, per-token, MoE): the reference first,
    then the cases in ``DEFAULT_CASES`` order (controls last), each with its policy losses in
    ``POLICY_LOSSES`` order; unknown layouts at the end."""
    by_line = {}
    for row in rows:
        by_line.setdefault((row["layout"], row["policy_loss"]), {})[row["mode"]] = row
    names = []
    for kind, label in REFERENCE_LABELS.items():
        names.append("single-process reference" + label)
        members = [case for case in DEFAULT_CASES if case.model_kind == kind]
        names += [c.name for c in members if not c.expect_fail] + [c.name for c in members if c.expect_fail]
    names += [name for name, _ in by_line if name not in names]
    lines = [TABLE_HEADER, "|---" * (len(MODES) + 2) + "|"]
    for name in dict.fromkeys(names):
        for policy in POLICY_LOSSES:
            cells = by_line.get((name, policy))
            if cells is None:
                continue
            text = [_table_cell(cells[m]) if m in cells else "-" for m in MODES]
            lines.append(f"| {name} | {policy} | " + " | ".join(text) + " |")
    return "\n".join(lines) + "\n"


def find_markdown_table(text: str) -> tuple:
    """``(start, end)`` character offsets of the parity table in ``text`` (docs/parity.md): from its
    header line to the end of its last row."""
    start = text.index(TABLE_HEADER + "\n")
    end = start
    for line in text[start:].splitlines(keepends=True):
        if not line.startswith("|"):
            break
        end += len(line)
    return start, end


def plot_errors(rows, path: str) -> None:
    """PNG of the max relative gradient error per layout and policy loss (one marker per mode)
    against the tolerance."""
    try:
        import matplotlib  # noqa: PLC0415  (optional: the [plot] extra)
    except ImportError as err:
        raise SystemExit("--plot needs matplotlib: pip install 'megatron_pg_agg[plot]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    lines = list(dict.fromkeys((r["layout"], r["policy_loss"]) for r in rows
                               if not r["layout"].startswith("single")))
    fig, ax = plt.subplots(figsize=(10, 0.3 * len(lines) + 1.5))
    for k, mode in enumerate(MODES):
        ys, xs = [], []
        for i, line in enumerate(lines):
            for r in rows:
                if (r["layout"], r["policy_loss"]) == line and r["mode"] == mode:
                    ys.append(i + (k - 1.5) * 0.12)
                    xs.append(max(r["grad_max_rel_err"], 1e-12))
        ax.scatter(xs, ys, label=mode, s=14)
    ax.axvline(GRAD_RTOL, color="red", linestyle="--", label=f"tolerance {GRAD_RTOL:g}")
    ax.set_xscale("log")
    ax.set_ylim(-0.5, len(lines) - 0.5)
    ax.set_yticks(range(len(lines)), [f"{name} [{policy}]" for name, policy in lines], fontsize=6)
    ax.set_xlabel("max relative gradient error vs single-process reference")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

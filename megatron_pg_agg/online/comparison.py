"""The length-bias comparison: online GRPO on the reach task, one run per (seed, variant).

    torchrun --nproc_per_node 2 launch/grpo_reach.py                 # 3 seeds x 5 variants
    torchrun --nproc_per_node 2 launch/grpo_reach.py --quick         # 1 seed, the quick setting

Per seed: one supervised warm-up from the seed's initial weights, then every variant starts from
that checkpoint (weights copied back, a fresh Adam) and sees the same prompts at each step. Rank 0
writes, into ``--out`` (a folder of its own: :mod:`megatron_pg_agg.data.output_folder`):

* ``steps.jsonl``: one record per (seed, variant, step): accuracy, mean length of correct and of
  incorrect responses, truncated fraction, objective, grad norm, timings;
* ``summary.md``: the table of :func:`summary_rows` (first and last quarter of the steps);
* ``length_bias.png``: incorrect length, correct length and accuracy against step, a line per
  variant (the mean over seeds) and a band (min to max over the seeds).

Variants (:data:`VARIANTS`): the loss aggregation is the trainer's ``--pg-loss-aggregation``;
the std division is the advantage's (:func:`~megatron_pg_agg.online.grpo.group_advantages`).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass

__all__ = ["VARIANTS", "Variant", "summary_rows"]

logger = logging.getLogger(__name__)

OUTPUT_KIND = "grpo_reach"
"""The output folder's kind (its marker: only an earlier comparison's folder is replaced)."""


@dataclass(frozen=True)
class Variant:
    """One objective of the comparison."""

    name: str
    """Short name (records, flags)."""
    label: str
    """Legend label."""
    mode: str
    """``--pg-loss-aggregation``."""
    divide_by_std: bool
    """Advantages divided by the group's reward std."""


VARIANTS = (
    Variant("grpo", "GRPO: seq_mean + std", "seq_mean", True),
    Variant("dapo", "DAPO: token_mean + std", "token_mean", True),
    Variant("dr_grpo", "Dr. GRPO: constant, no std", "constant", False),
    Variant("seq_mean_no_std", "ablation: seq_mean, no std", "seq_mean", False),
    Variant("constant_std", "ablation: constant + std", "constant", True),
)
BY_NAME = {v.name: v for v in VARIANTS}

QUICK = dict(seeds=1, steps=60, variants=("grpo", "dr_grpo"))
"""``--quick``: one seed, the two variants the CI check compares, fewer steps."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo_reach",
        description="Online GRPO on the reach task: the length bias of each loss aggregation "
                    "(docs/length-bias.md). Flags not listed here go to the trainer (model size, ...).")
    parser.add_argument("--out", default="runs/grpo_reach", help="output folder (steps.jsonl, summary.md, "
                        "length_bias.png); replaced only if an earlier comparison wrote it")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (each: its own warm-up)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=150, help="RL steps per run")
    parser.add_argument("--variants", default=",".join(v.name for v in VARIANTS),
                        help="comma-separated, from: " + ", ".join(v.name for v in VARIANTS))
    parser.add_argument("--quick", action="store_true",
                        help="1 seed, 60 steps, grpo and dr_grpo only (the CI check's setting)")
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--updates-per-batch", type=int, default=2)
    parser.add_argument("--rl-lr", type=float, default=1e-3, help="Adam learning rate of the RL runs")
    parser.add_argument("--warmup-steps", type=int, default=60, help="supervised warm-up steps per seed")
    parser.add_argument("--warmup-lr", type=float, default=3e-3, help="Adam learning rate of the warm-up")
    parser.add_argument("--check-on-policy-every", type=int, default=0, metavar="N",
                        help="every N-th step also record on_policy_error: the largest gap between the "
                             "sampler's and the trainer's log-probs before the update (0: never)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    parser.add_argument("--log-every", type=int, default=10, help="progress line every N steps")
    return parser


def trainer_flags(task, mode: str, extra: list) -> list:
    """The trainer flags of a run: the task's vocabulary and lengths, the mode (constant: divisor =
    the longest response), no plan-ahead (online), then the user's ``extra`` (which win)."""
    flags = ["--vocab-size", str(task.vocab_size),
             "--max-position-embeddings", str(_round_up(task.prompt_tokens + task.max_response_tokens, 8)),
             "--pg-loss-aggregation", mode, "--no-pg-plan-ahead", "--max-tokens-per-microbatch", "1024"]
    if mode == "constant":
        flags += ["--pg-loss-aggregation-divisor", str(task.max_response_tokens)]
    return flags + list(extra)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def summary_rows(records: list) -> list:
    """Per variant: means over seeds of the first and last quarter of the steps of accuracy, incorrect
    and correct length and truncated fraction, and the last-quarter incorrect length over Dr. GRPO's."""
    by_variant: dict = {}
    for r in records:
        by_variant.setdefault(r["variant"], {}).setdefault(r["seed"], []).append(r)
    rows = []
    for name, seeds in by_variant.items():
        row = {"variant": name, "seeds": len(seeds)}
        for part in ("first", "last"):
            for key in ("accuracy", "length_incorrect", "length_correct", "truncated"):
                per_seed = [_quarter_mean(steps, key, part) for steps in seeds.values()]
                per_seed = [v for v in per_seed if not math.isnan(v)]
                row[f"{key}_{part}"] = sum(per_seed) / len(per_seed) if per_seed else float("nan")
                if part == "last" and key == "length_incorrect":
                    row["length_incorrect_last_by_seed"] = per_seed
        rows.append(row)
    reference = next((r for r in rows if r["variant"] == "dr_grpo"), None)
    for row in rows:
        row["incorrect_vs_dr_grpo"] = (row["length_incorrect_last"] / reference["length_incorrect_last"]
                                       if reference else float("nan"))
    return rows


def _quarter_mean(steps: list, key: str, part: str) -> float:
    """Mean of ``key`` over the first or last quarter of the steps (NaN entries skipped)."""
    steps = sorted(steps, key=lambda r: r["step"])
    quarter = max(1, len(steps) // 4)
    chosen = steps[:quarter] if part == "first" else steps[-quarter:]
    values = [r[key] for r in chosen if not math.isnan(r[key])]
    return sum(values) / len(values) if values else float("nan")


def summary_markdown(rows: list) -> str:
    head = ("| variant | seeds | accuracy first -> last | incorrect length first -> last | "
            "correct length first -> last | truncated last | incorrect vs Dr. GRPO |\n"
            "|---|---|---|---|---|---|---|\n")
    lines = [f"| {r['variant']} | {r['seeds']} | {r['accuracy_first']:.2f} -> {r['accuracy_last']:.2f} | "
             f"{r['length_incorrect_first']:.1f} -> {r['length_incorrect_last']:.1f} | "
             f"{r['length_correct_first']:.1f} -> {r['length_correct_last']:.1f} | "
             f"{r['truncated_last']:.2f} | {r['incorrect_vs_dr_grpo']:.2f}x |" for r in rows]
    return head + "\n".join(lines) + "\n"


def plot(records: list, path: str) -> None:
    """Three panels against step (incorrect length, correct length, accuracy): per variant the mean
    over seeds and a min-max band."""
    import matplotlib  # noqa: PLC0415  (only for the plot)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    panels = (("length_incorrect", "incorrect-response length (tokens)"),
              ("length_correct", "correct-response length (tokens)"), ("accuracy", "accuracy"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    names = [v.name for v in VARIANTS if any(r["variant"] == v.name for r in records)]
    for name in names:
        runs: dict = {}
        for r in records:
            if r["variant"] == name:
                runs.setdefault(r["seed"], {})[r["step"]] = r
        steps = sorted(set.intersection(*(set(s) for s in runs.values())))
        for ax, (key, title) in zip(axes, panels):
            values = [[runs[seed][k][key] for seed in runs] for k in steps]
            mean = [_nanmean(v) for v in values]
            line, = ax.plot(steps, mean, label=BY_NAME[name].label, linewidth=1.6)
            if len(runs) > 1:
                ax.fill_between(steps, [_nanmin(v) for v in values], [_nanmax(v) for v in values],
                                color=line.get_color(), alpha=0.18, linewidth=0)
            ax.set_title(title)
            ax.set_xlabel("RL step")
    axes[2].legend(loc="lower right", fontsize=8)
    seeds = len({r["seed"] for r in records})
    fig.suptitle(f"Online GRPO on the reach task: mean over {seeds} seed{'s' * (seeds > 1)}"
                 + (" (band: min to max)" if seeds > 1 else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _finite(values):
    return [v for v in values if not math.isnan(v)] or [float("nan")]


def _nanmean(values):
    finite = _finite(values)
    return sum(finite) / len(finite)


def _nanmin(values):
    return min(_finite(values))


def _nanmax(values):
    return max(_finite(values))


def write_outputs(folder: str, records: list, *, with_plot: bool) -> list:
    """``summary.md`` and (unless ``with_plot`` is False) ``length_bias.png`` in ``folder``; returns
    the summary rows."""
    rows = summary_rows(records)
    with open(os.path.join(folder, "summary.md"), "w") as f:
        f.write(summary_markdown(rows))
    if with_plot:
        plot(records, os.path.join(folder, "length_bias.png"))
    return rows


def write_record(file, record: dict) -> None:
    file.write(json.dumps(record) + "\n")
    file.flush()


def elapsed(t0: float) -> str:
    seconds = time.perf_counter() - t0
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def remove_own_temp(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)

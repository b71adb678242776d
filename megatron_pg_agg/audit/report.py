"""The audit's report: one screen of text, the JSON (``--json``) and what both are made from."""
from __future__ import annotations

import json
from dataclasses import dataclass

from megatron_pg_agg.audit.measure import spread

__all__ = ["AuditReport"]


@dataclass(frozen=True)
class AuditReport:
    """Everything the audit found for one host config."""

    host: str
    """The host's name as the command takes it."""
    stock: str
    """The stock aggregation as a formula, with the config's values."""
    settings: dict
    """The config's keys that decide the aggregation and the split, with their values."""
    rows: int
    """Rows (responses) of the synthetic collection."""
    tokens: int
    """Valid tokens of the synthetic collection."""
    splits: list
    """``SplitResult`` per split of the stock loss, the configured split first."""
    plugin: list
    """``SplitResult`` per split of the plug-in line, same splits."""
    length_weight_ratio: object
    """Weight of a token of the longest response over one of the shortest (configured split); None if undefined."""
    fix: str
    """The one config line that makes the host's loss exact."""
    seconds: float = 0.0
    """Wall time of the audit, imports included."""
    refused: dict = None
    """``{split name: the host's message}`` for the neighbouring splits the host's own code refuses."""

    @property
    def spread(self) -> float:
        return spread(self.splits)

    @property
    def plugin_spread(self) -> float:
        """The plug-in's spread over the splits whose optimizer steps hold the configured split's rows: which
        rows the host puts in a step is its scheduler's choice (verl's ``trainer.balance_batch`` with the DP
        size), which no loss changes; each step's objective is what the plug-in makes exact."""
        return spread(self.same_steps(self.plugin))

    @staticmethod
    def same_steps(results: list) -> list:
        return [r for r in results if r.members == results[0].members]

    def moved_steps(self) -> list:
        """The splits whose optimizer steps hold other rows than the configured split's (the plug-in's line)."""
        return [r.split.name for r in self.plugin if r.members != self.plugin[0].members]

    def cut_groups(self) -> dict:
        """``{split name: [group lines]}`` for the splits whose steps cut a prompt group."""
        return {r.split.name: r.cut for r in self.splits if r.cut}

    def to_json(self) -> dict:
        def rows(results):
            return [{"split": r.split.name, "settings": r.split.settings, "objective": r.objective,
                     "step_objectives": r.steps.tolist(),
                     "relative": r.relative, "gradient": r.gradient, "cut_groups": len(r.cut)} for r in results]

        return {"host": self.host, "stock": self.stock, "settings": self.settings, "rows": self.rows,
                "tokens": self.tokens, "splits": rows(self.splits), "spread": self.spread,
                "cut_groups": self.cut_groups(), "length_weight_ratio": self.length_weight_ratio,
                "fix": self.fix, "plugin_splits": rows(self.plugin), "plugin_spread": self.plugin_spread,
                "refused_splits": self.refused or {}, "other_step_membership": self.moved_steps(),
                "seconds": self.seconds}

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2, default=str)  # a host's config objects as their repr
            f.write("\n")

    def render(self) -> str:
        width = max(len(r.split.name) for r in self.splits)
        lines = [f"megatron_pg_agg audit: {self.host}",
                 "config: " + ", ".join(f"{k}={v}" for k, v in self.settings.items()),
                 f"stock loss: {self.stock}",
                 f"synthetic collection: {self.rows} responses, {self.tokens} valid tokens",
                 "",
                 f"{'split':<{width}}  {'J (mean of steps)':>17}  {'relative':>9}  {'gradient':>9}  "
                 f"{'plug-in J':>10}  J per step",
                 ]
        for stock, plugin in zip(self.splits, self.plugin):
            per_step = " / ".join(f"{float(v):.4g}" for v in stock.steps[:4]) + (" ..." if len(stock.steps) > 4 else "")
            lines.append(f"{stock.split.name:<{width}}  {stock.objective:>17.6g}  {stock.relative:>9.2e}  "
                         f"{stock.gradient:>9.2e}  {plugin.objective:>10.6g}  {per_step}")
        lines += [f"{name}: refused by the host ({message[:100]})" for name, message in (self.refused or {}).items()]
        lines += ["", f"worst spread (objective or token weights): {self.spread:.3g}"]
        cut = self.cut_groups()
        if cut:
            lines.append("prompt groups cut across optimizer steps:")
            lines += [f"  {name}: {len(groups)} ({'; '.join(groups[:3])}{' ...' if len(groups) > 3 else ''})"
                      for name, groups in cut.items()]
        else:
            lines.append("prompt groups cut across optimizer steps: none")
        ratio = self.length_weight_ratio
        lines.append("token weight, longest / shortest response: "
                     + ("undefined" if ratio is None else f"{ratio:.3g}"))
        if self.spread < 1e-6:
            lines.append("the stock loss does not move with the split on this config: the line below makes it train "
                         "a mode you choose, exact in every split")
        lines += ["", f"to make it exact: {self.fix}",
                  f"  the plug-in's spread on the same batch: {self.plugin_spread:.2e}"]
        moved = self.moved_steps()
        if moved:
            lines.append(f"  (over the splits with the configured steps' rows; in {len(moved)} others ("
                         f"{', '.join(moved[:3])}{' ...' if len(moved) > 3 else ''}) the host's scheduler puts other "
                         "rows in a step, which no loss changes)")
        if self.seconds:
            lines.append(f"({self.seconds:.1f} s)")
        return "\n".join(lines)

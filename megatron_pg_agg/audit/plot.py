"""The audit's figure (``--plot``): stock against plug-in per split, and token weight against response length."""
from __future__ import annotations

from megatron_pg_agg.audit.measure import row_weights

__all__ = ["plot"]


def plot(report, batch, path: str) -> None:
    """Write the figure of ``report`` (made on ``batch``) to ``path`` (PNG)."""
    import matplotlib  # noqa: PLC0415  (the plot extra: only --plot needs it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r.split.name for r in report.splits]
    x = range(len(names))
    left.plot(x, [r.objective for r in report.splits], "o-", label="stock")
    left.plot(x, [r.objective for r in report.plugin], "s--", label="plug-in")
    left.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
    left.set_ylabel("objective J")
    left.set_title(f"{report.host}: J per split (stock spread {report.spread:.2g})")
    left.legend()
    for label, result, marker in (("stock", report.splits[0], "o"), ("plug-in", report.plugin[0], "s")):
        weights = row_weights(result, batch)
        xs, ys = [int(batch.masks[i].sum()) for i in weights], list(weights.values())
        right.scatter(xs, ys, marker=marker, s=14, label=label, alpha=0.7)
    right.set_xlabel("valid tokens of the response")
    right.set_ylabel("token weight |dJ/dlogp| / (|A| r)")
    right.set_title(f"token weight vs length ({report.splits[0].split.name})")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

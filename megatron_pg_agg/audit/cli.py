"""``python -m megatron_pg_agg.audit HOST [--config FILE] [OVERRIDES ...] [--json FILE] [--plot FILE.png] [-- ARGV]``

What a host's own config makes its stock loss optimise, how much that moves with the split, and the one
line that makes it exact (docs/audit.md). Exit status: 0 after the report; 2 when the host is not
installed or refuses the config (one line), as the project's other commands refuse.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from typing import Optional

from megatron_pg_agg.audit.hosts import HOSTS, HostMissing, HostRefusal

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_pg_agg.audit", description=__doc__.split("\n\n")[1])
    p.add_argument("host", choices=sorted(HOSTS), help="the host whose config is audited")
    p.add_argument("overrides", nargs="*", help="overrides in the host's own syntax")
    p.add_argument("--config", help="the host's config file (verl: a YAML composed by Hydra; Megatron-LM and "
                                    "slime: a file of command-line arguments)")
    p.add_argument("--json", help="write the report's data to this file")
    p.add_argument("--plot", help="write the figure to this PNG (needs matplotlib)")
    p.add_argument("--dp", type=int, default=None,
                   help="the run's data-parallel size (Megatron-LM: world size / TP x PP x CP, not in its flags: "
                        "default 2; AReaL, NeMo-RL: overrides the size their config gives; slime, verl: read from "
                        "their config)")
    p.add_argument("--loop", choices=("rl", "pretrain"), default=None,
                   help="megatron-lm: the loop audited, its RL loop (train_rl.py) or pretrain() (pretrain_gpt.py); "
                        "default: the script the command line after -- starts with, else rl")
    p.add_argument("--seed", type=int, default=0, help="the synthetic batch's seed")
    p.add_argument("--max-rows", type=int, default=512,
                   help="verl: above this many responses per rollout, audit the prompts per rollout and per "
                        "mini-batch divided by one factor (steps per rollout, group size, micro-batches and DP kept)")
    return p


def _split_argv(argv: list) -> tuple:
    """``(the audit's arguments, the host's command line after --)``."""
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1:]
    return argv, []


def audit(host: str, options, host_argv: list):
    """``(report, batch)`` of one host's audit."""
    from megatron_pg_agg.audit.batch import synthetic_batch  # noqa: PLC0415
    from megatron_pg_agg.audit.measure import length_weight_ratio, measure_splits  # noqa: PLC0415
    from megatron_pg_agg.audit.report import AuditReport  # noqa: PLC0415

    module = importlib.import_module(HOSTS[host])
    config = module.load(options.config, options.overrides, host_argv, options)
    batch = synthetic_batch(config.shape)
    refused = {}
    splits = measure_splits(module.stock, config, batch, config.splits, refused)
    if not splits or splits[0].split != config.splits[0]:
        raise HostRefusal(f"the configured split is refused by {host}'s own code: {refused[config.splits[0].name]}")
    plugin = measure_splits(module.plugin, config, batch, [r.split for r in splits])
    report = AuditReport(host, config.stock, config.settings, batch.rows, batch.valid_tokens(), splits, plugin,
                         length_weight_ratio(splits[0], batch), config.fix, refused=refused)
    return report, batch


def main(argv: Optional[list] = None) -> int:
    started = time.perf_counter()
    own, host_argv = _split_argv(list(sys.argv[1:] if argv is None else argv))
    options = parser().parse_intermixed_args(own)
    try:
        report, batch = audit(options.host, options, host_argv)
    except (HostMissing, HostRefusal) as error:
        print(f"refusing to audit {options.host}: {error}", file=sys.stderr)
        return 2
    report = type(report)(**{**report.__dict__, "seconds": time.perf_counter() - started})
    print(report.render())
    if options.json:
        report.write_json(options.json)
    if options.plot:
        from megatron_pg_agg.audit.plot import plot  # noqa: PLC0415

        plot(report, batch, options.plot)
    return 0

"""Layout parity: one optimizer step under several parallel layouts against a single-device reference.

    python -m megatron_pg_agg.parity                      # every layout, mode and policy loss
    python -m megatron_pg_agg.parity --modes seq_mean --policy-losses ppo,gspo --json out.json --plot errors.png

The launcher groups the layouts by world size and starts one ``torchrun`` per group (many layouts
per launch: start-up dominates). Each worker computes the reference on its own (TP = PP = 1,
per-sequence forward passes, the objective in float64 Python sums written from the README's
formulas, sharing no code with the package's loss or aggregation, autograd), then for every
layout: builds the model with the reference weights (TP shards sliced by ``partition_dim``,
pipeline layers mapped by ``layer_number``), plans the step, runs megatron-core's real
forward-backward schedule with DDP and ``finalize_model_grads``, gathers the gradient shards and
compares: the logged objective within 1e-6 relative, every parameter's gradient within 1e-5
(max abs error / max abs reference value). Layouts marked as controls are negative controls:
they pass the check only if parity FAILS. Exit status 0 iff every row passes.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

from megatron_pg_agg.megatron.torchrun import torchrun_command
from megatron_pg_agg.patches import mtp_loss
from megatron_pg_agg.versions import in_range, installed_megatron_core_version

from .fixture import DEFAULT_CASES, MODES, POLICY_LOSSES
from .report import plot_errors, print_table

__all__ = ["launch", "main"]


def _csv(choices):
    def parse(text: str) -> list:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(choices)} (comma-separated)")
        return values
    return parse


def launch(cases, modes, policy_losses=POLICY_LOSSES, *, timeout_s: float = 900.0, log=print,
           echo: bool = False) -> list:
    """Run ``cases`` (grouped by world size, one torchrun each) and return every row."""
    rows = []
    by_world = {}
    for case in cases:
        by_world.setdefault(case.world, []).append(case)
    for world, group in sorted(by_world.items()):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            cmd = [*torchrun_command(), "--standalone", "--nproc_per_node",
                   str(world), "-m", "megatron_pg_agg.parity.workers", "--out", out,
                   "--cases-json", json.dumps([asdict(case) for case in group]), "--modes", *modes,
                   "--policy-losses", *policy_losses]
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            runs = sum(len(case.runs(modes, policy_losses)) for case in group)
            log(f"[parity] launching {world} ranks: {len(group)} layouts, {runs} rows", flush=True)
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)
            lines = []
            try:
                for line in proc.stdout:
                    lines.append(line)
                    if echo:
                        log("  " + line.rstrip(), flush=True)
                    if time.monotonic() - t0 > timeout_s:
                        raise subprocess.TimeoutExpired(cmd, timeout_s)
                proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                raise RuntimeError(f"parity launch ({world} ranks) timed out after {timeout_s:.0f}s:\n"
                                   + "".join(lines[-200:])) from None
            if proc.returncode != 0 or not os.path.exists(out):
                raise RuntimeError(f"parity launch ({world} ranks) failed with rc={proc.returncode}:\n"
                                   + "".join(lines[-200:]))
            with open(out) as f:
                got = json.load(f)
            log(f"[parity] {world} ranks done in {time.monotonic() - t0:.1f}s", flush=True)
            seen = {(r["layout"], r["policy_loss"], r["mode"]) for r in rows}
            rows.extend(r for r in got if (r["layout"], r["policy_loss"], r["mode"]) not in seen)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-pg-agg-parity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", type=_csv(MODES), default=list(MODES),
                        help=f"comma-separated aggregation modes (default: {','.join(MODES)})")
    parser.add_argument("--policy-losses", type=_csv(POLICY_LOSSES), default=list(POLICY_LOSSES),
                        help=f"comma-separated policy losses (default: {','.join(POLICY_LOSSES)})")
    parser.add_argument("--layouts", nargs="+", help="substrings selecting layouts by name (default: all)")
    parser.add_argument("--no-controls", action="store_true", help="skip the negative controls")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--plot", help="write a PNG of the gradient errors per layout here")
    parser.add_argument("--verbose", action="store_true", help="echo the workers' output (rows as they finish)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per torchrun launch")
    parser.add_argument("--fuzz", type=int, metavar="N",
                        help="instead of the table: N random cases against the float64 reference (parity/fuzz.py)")
    parser.add_argument("--seed", type=int, help="the fuzz run's seed (default: a random one, printed)")
    parser.add_argument("--fuzz-case", type=int, metavar="SEED", help="rerun one fuzz case by its own seed")
    args = parser.parse_args(argv)
    if args.fuzz is not None or args.fuzz_case is not None:
        if args.fuzz is not None and args.fuzz < 1:
            parser.error("--fuzz needs N >= 1")
        from . import fuzz  # noqa: PLC0415

        if args.timeout == 900.0:
            args.timeout = 3600.0  # one launch per world size holds many cases
        return fuzz.main(args)
    mtp_release = in_range(installed_megatron_core_version(), mtp_loss.SUPPORTED)
    if not mtp_release:
        print(f"note: the MTP layouts are left out: {mtp_loss.UNSUPPORTED_REASON}", file=sys.stderr)
    cases = [case for case in DEFAULT_CASES
             if (args.layouts is None or any(s in case.name for s in args.layouts))
             and not (args.no_controls and case.expect_fail)
             and (mtp_release or not case.mtp)
             and case.runs(args.modes, args.policy_losses)]
    if not cases:
        parser.error("no layout matches --layouts, --modes and --policy-losses")
    rows = launch(cases, args.modes, args.policy_losses, timeout_s=args.timeout, echo=args.verbose,
                  log=lambda *a, **k: print(*a, file=sys.stderr, **k))
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot_errors(rows, args.plot)
    failed = [r for r in rows if not r["passed"]]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 0 if not failed else 1

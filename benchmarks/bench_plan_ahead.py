"""The next plan in the background (``--pg-plan-ahead``): the planner's time hidden behind a step.

    python benchmarks/bench_plan_ahead.py                    # 1M-token steps, a step 1.5 x the plan
    python benchmarks/bench_plan_ahead.py --tokens 2 --step-ms 800 --work matmul
    python benchmarks/bench_plan_ahead.py --glibc-default    # without the launcher's malloc setting

A loop of ``--steps`` optimizer steps over three distinct rollout steps of ``--tokens`` million
response tokens each (built as benchmarks/bench_planner.py builds them: DP=8 x 16 microbatches),
where each step is ``PlanAhead.get(i)`` followed by a simulated step of known duration on the main
thread: ``sleep`` (the host idle while a GPU runs the step; the default) or ``matmul`` (a torch
matmul loop on one host thread, the host busy). Run with plan-ahead on, then off (the plan built
when the step starts, as before); the first step of each run is left out (nothing precedes it to
hide its plan behind). Printed: the planner's time per step, the simulated step, and the time per
step beyond the simulated step ("exposed": what the loop waited for its plan), on and off. With a
step longer than its plan, "exposed" is near 0 with plan-ahead and about the plan time without.
The process first applies the launcher's malloc setting, as training and bench_planner.py do.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_planner, run as a script

from bench_planner import DP, MICROBATCHES, add_malloc_args, apply_malloc_setting, make_batch  # noqa: E402

from megatron_pg_agg.core.losses import PGLossConfig  # noqa: E402
from megatron_pg_agg.data.plan_ahead import PlanAhead  # noqa: E402
from megatron_pg_agg.data.planner import PlanConfig, plan_step  # noqa: E402


def simulated_step(seconds: float, work: str) -> None:
    """A step of ``seconds`` on the main thread: sleeping, or multiplying matrices until then."""
    if work == "sleep":
        time.sleep(seconds)
        return
    a = torch.randn(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def run(batches: list, cfg, plan_cfg, *, steps: int, step_s: float, work: str, enabled: bool) -> dict:
    """Wall time per step (steps 1.. of the loop) beyond ``step_s``, and the planner's time per step."""
    walls, first_wait = [], 0.0
    plans = PlanAhead(lambda i: plan_step(batches[i % len(batches)], cfg, plan_cfg), range(steps), enabled=enabled)
    try:
        for i in range(steps):
            t0 = time.perf_counter()
            plan = plans.get(i)
            if i == 0:
                first_wait = plans.waited_s
            simulated_step(step_s, work)
            walls.append(time.perf_counter() - t0)
            del plan
    finally:
        plans.close()
    measured = walls[1:]
    return {"wall_ms": statistics.mean(measured) * 1e3, "exposed_ms": statistics.mean(measured) * 1e3 - step_s * 1e3,
            "plan_ms": plans.planned_s / plans.handed_out * 1e3, "waited_ms": (plans.waited_s - first_wait) / (plans.handed_out - 1) * 1e3}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1, help="millions of response tokens per step")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run (the first is left out)")
    parser.add_argument("--step-ms", type=float, default=None,
                        help="simulated step (default: 1.5 x the measured plan time)")
    parser.add_argument("--work", choices=("sleep", "matmul"), default="sleep")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    add_malloc_args(parser)
    args = parser.parse_args(argv)
    apply_malloc_setting(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = PGLossConfig(mode="prompt_mean")
    plan_cfg = PlanConfig(dp_size=DP, num_microbatches=MICROBATCHES)
    batches = [make_batch(args.tokens, 8, seed=s) for s in range(3)]
    for b in batches:  # warm-up, and the plan time the default step is sized from
        plan_step(b, cfg, plan_cfg)
    t0 = time.perf_counter()
    for b in batches:
        plan_step(b, cfg, plan_cfg)
    plan_s = (time.perf_counter() - t0) / len(batches)
    step_s = args.step_ms / 1e3 if args.step_ms is not None else 1.5 * plan_s
    print(f"{args.tokens}M response tokens per step ({sum(len(b) for b in batches) // 3} sequences), "
          f"DP={DP} x {MICROBATCHES} microbatches; plan {plan_s * 1e3:.0f} ms; simulated step "
          f"{step_s * 1e3:.0f} ms ({args.work}); torch threads {torch.get_num_threads()}", flush=True)
    results = {}
    for name, enabled in (("on", True), ("off", False)):
        results[name] = r = run(batches, cfg, plan_cfg, steps=args.steps, step_s=step_s, work=args.work,
                                enabled=enabled)
        print(f"plan ahead {name}: {r['wall_ms']:.0f} ms per step, plan {r['plan_ms']:.0f} ms, "
              f"waited for plans {r['waited_ms']:.0f} ms", flush=True)
    on, off = results["on"], results["off"]
    print(f"plan ahead: step {step_s * 1e3:.0f} ms, plan {off['plan_ms']:.0f} ms, exposed {on['exposed_ms']:.0f} ms "
          f"(off: {off['exposed_ms']:.0f} ms)")


if __name__ == "__main__":
    main()

"""The comparison's process side: one trainer session, every (seed, variant) run in turn.

Kept apart from :mod:`.comparison` (flags, table, plot) because it imports megatron-core.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch.distributed as dist

from megatron_pg_agg.core.losses import PGLossConfig
from megatron_pg_agg.data.output_folder import (
    OutputFolderError,
    new_output_folder,
    output_folder_problem,
    replace_output_folder,
)
from megatron_pg_agg.data.reach import ReachTask
from megatron_pg_agg.training.run_config import RunConfig, StartupError, parse_flags
from megatron_pg_agg.training.trainer import setup
from megatron_pg_agg.training.worker_process import release_process_group

from .comparison import OUTPUT_KIND, elapsed, remove_own_temp, trainer_flags, write_outputs, write_record
from .grpo import OnlineRun

logger = logging.getLogger(__name__)


def online_problems(cfg: RunConfig, steps: int, world: int) -> list:
    """What the online entry refuses before any process group: the trainer's own online checks
    (:meth:`RunConfig.online_problems`: the sampler runs the model's whole forward on every rank,
    a different number of times on each; the prompts split evenly over DP), ``--steps`` below 1,
    and ``--rollouts``."""
    if cfg.online is None:
        return ["--rollouts: grpo_reach samples its rollouts from the live policy; it reads no rollout file"]
    return cfg.online_problems(world) + ([f"--steps {steps} must be >= 1"] if steps < 1 else [])


def run_comparison(args, variants: list, extra: list) -> int:
    task = ReachTask()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        online = ["--prompts-per-step", args.prompts_per_step, "--group-size", args.group_size,
                  "--updates-per-batch", args.updates_per_batch, "--warmup-steps", args.warmup_steps,
                  "--warmup-lr", args.warmup_lr]
        base = RunConfig.from_args(parse_flags(trainer_flags(task, "token_mean", [*map(str, online), *extra])))
        problems = online_problems(base, args.steps, world)
        problems += output_folder_problem(args.out, "--out", kind=OUTPUT_KIND)
        if problems:
            raise StartupError(problems)
    except (StartupError, ValueError) as err:
        logger.error(str(err))
        return 2
    grpo = base.online
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    try:
        session = setup(base, steps={}, data=f"online GRPO on the reach task: {len(variants)} variant(s), each "
                                             f"its own mode, {grpo.prompts_per_step} prompts x {grpo.group_size} "
                                             "samples per step")
    except StartupError as err:  # the trainer's own start-up checks (every rank reaches the same)
        logger.error(str(err))
        release_process_group()
        return 2
    run = OnlineRun(session, task)
    initial = run.snapshot()  # the trainer's --seed initialisation: every seed's warm-up starts here
    rank0 = dist.get_rank() == 0
    temp = new_output_folder(args.out) if rank0 else None
    progress = _Progress(len(seeds) * len(variants) * args.steps, args.log_every)
    logger.info(f"{len(seeds)} seed(s) x {len(variants)} variant(s) x {args.steps} steps, "
                f"{grpo.prompts_per_step} prompts x {grpo.group_size} samples per step, "
                f"DP={run.dp_size}; records: {os.path.join(temp, 'steps.jsonl') if temp else ''}")
    try:
        records: list = []
        with open(os.path.join(temp, "steps.jsonl"), "w") if rank0 else open(os.devnull, "w") as out:
            for seed in seeds:
                t0 = time.perf_counter()
                run.warm_up(grpo, seed, initial)
                start = run.snapshot()
                warm = run.evaluate(grpo, seed)
                logger.info(f"seed {seed}: warm-up {grpo.warmup_steps} steps in {elapsed(t0)}: accuracy "
                            f"{warm['accuracy']:.2f}, incorrect length {warm['length_incorrect']:.1f}, "
                            f"correct length {warm['length_correct']:.1f}")
                for variant in variants:
                    loss = PGLossConfig(mode=variant.mode,
                                        divisor=float(task.max_response_tokens) if variant.mode == "constant" else None)
                    run.reset(start, loss, args.rl_lr)
                    cfg = dataclasses.replace(grpo, advantage_std=variant.divide_by_std)
                    for step in range(args.steps):
                        check = args.check_on_policy_every > 0 and step % args.check_on_policy_every == 0
                        record = {"seed": seed, "variant": variant.name,
                                  **run.rl_step(cfg, seed, step, check_on_policy=check)}
                        write_record(out, record)
                        records.append(record)
                        progress.step(record, args.steps)
        if rank0:
            _finish(args, temp, records)
    except OutputFolderError as err:
        logger.error(str(err))
        return 2
    except BaseException:
        if temp:
            remove_own_temp(temp)  # this run's own hidden folder, nothing else
        raise
    finally:
        run.s.plans.close()
    release_process_group()
    return 0



class _Progress:
    """Rank 0's progress line every ``every`` steps of a run, with the time left of the whole job."""

    def __init__(self, total_steps: int, every: int):
        self.total, self.every, self.done = total_steps, every, 0
        self.t0 = self.run_t0 = time.perf_counter()

    def step(self, record: dict, run_steps: int) -> None:
        self.done += 1
        step = record["step"] + 1
        if step == 1:
            self.run_t0 = time.perf_counter()
        if step % self.every and step != run_steps:
            return
        rate = (time.perf_counter() - self.run_t0) / step
        left = (self.total - self.done) * rate
        logger.info(f"seed {record['seed']} {record['variant']:<16} step {step:>3}/{run_steps} "
                    f"accuracy {record['accuracy']:.2f} incorrect length {record['length_incorrect']:5.1f} "
                    f"correct length {record['length_correct']:5.1f} ({rate:.2f} s/step, about "
                    f"{left / 60:.0f} min left)")


def _finish(args, temp: str, records: list) -> None:
    """Rank 0: the table and plot, the folder in place of ``--out``, the summary lines."""
    rows = write_outputs(temp, records, with_plot=not args.no_plot)
    replace_output_folder(temp, os.path.abspath(args.out), kind=OUTPUT_KIND, flag="--out")
    for row in rows:
        logger.info(f"{row['variant']:<16} accuracy {row['accuracy_first']:.2f} -> {row['accuracy_last']:.2f}, "
                    f"incorrect length {row['length_incorrect_first']:.1f} -> {row['length_incorrect_last']:.1f} "
                    f"({row['incorrect_vs_dr_grpo']:.2f}x Dr. GRPO's)")
    logger.info(f"done: {args.out}/summary.md, steps.jsonl" + ("" if args.no_plot else ", length_bias.png"))

"""End-to-end training step with the megatron_pg_agg loss against a Megatron-LM-style token-mean
loss on identical batches, and the collectives each one issues.

    python benchmarks/bench_step.py                       # 2 ranks (DP=2), timing, every mode
    python benchmarks/bench_step.py --tp 2 --count-only   # collectives per step, TP=2

One step = the project's step runner (``megatron_pg_agg.megatron.step.run_pg_step``: zero grads,
megatron-core's forward-backward schedule over the step's microbatches, packed THD, tiny GPT,
gloo, finalize_model_grads, the step's report pairs reduced once), then megatron-core's optimizer
step; the baseline runs through the same runner with its own forward step. Baseline
loss_func: megatron-core's ``vocab_parallel_cross_entropy`` for the log-probs, the same PPO clipped
surrogate, ``(masked sum, mask count)`` per microbatch (what Megatron-LM's GRPO loss returns).
Ours: ``pg_loss_func`` in each mode (entropy report off, as the baseline computes none; one row
with it on). Repetitions are interleaved across variants; the ratio is median(ours) /
median(baseline). Goal: at most 1.03 in every mode. Collectives are counted by
wrapping torch.distributed's functions in the workers: nothing may be added per microbatch.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from functools import partial

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier",
               "all_gather_object", "broadcast_object_list")


def _count_collectives(counter: Counter):
    import torch.distributed as dist

    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapped(*args, _name=name, _original=original, **kwargs):
            counter[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, wrapped)


def baseline_loss_func(mb, cfg, output_tensor):
    """Megatron-LM-style token mean: log-probs from megatron-core's vocab-parallel cross entropy."""
    import torch
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logprobs = -vocab_parallel_cross_entropy(output_tensor[0].float(), mb.labels[0])
    ratio = torch.exp(logprobs - mb.old_logprobs)
    adv = mb.advantages
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high))
    mask = mb.denominator_mask
    loss = torch.where(mask, pg, 0.0).sum()
    count = mask.sum().to(torch.int32)
    return loss, count, {"lm loss": torch.stack([loss.detach(), count.float()])}


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from megatron_pg_agg.patches import apply_megatron_patches

    apply_megatron_patches(cpu_gloo=True)
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_pg_agg.core.losses import PGLossConfig
    from megatron_pg_agg.core.modes import MODES
    from megatron_pg_agg.data.planner import PlanConfig, plan_step
    from megatron_pg_agg.data.synthetic import synthetic_rollouts
    from megatron_pg_agg.megatron.layout import ParallelSizes
    from megatron_pg_agg.megatron.loss_func import packed_seq_params, pg_loss_func
    from megatron_pg_agg.megatron.model import build_model_chunks, default_ddp_config, wrap_in_ddp
    from megatron_pg_agg.megatron.parallel import init_distributed, init_parallel
    from megatron_pg_agg.megatron.step import StepGroups, run_pg_step
    from megatron_pg_agg.parity.models import tiny_transformer_config

    init_distributed()
    init_parallel(ParallelSizes(tp=args.tp))
    vocab = 512
    config = tiny_transformer_config(num_layers=2, hidden_size=128, ffn_hidden_size=512, num_attention_heads=4,
                                     tensor_model_parallel_size=args.tp)
    torch.manual_seed(0)
    model = wrap_in_ddp(build_model_chunks(config, vocab, 256), config, default_ddp_config())
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-5, clip_grad=1.0), model)
    rollouts = synthetic_rollouts(num_steps=1, prompts_per_step=16, group_size=8, vocab_size=vocab, seed=3)[0]
    dp_rank = parallel_state.get_data_parallel_rank()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    dp = parallel_state.get_data_parallel_world_size()

    variants = {"baseline (Megatron-LM token mean)": None}
    for mode in MODES:
        variants[mode] = PGLossConfig(mode=mode, divisor=64.0 if mode == "constant" else None,
                                      clip_eps_high=0.28, report_entropy=False)
    variants["seq_mean + entropy report"] = PGLossConfig(mode="seq_mean", clip_eps_high=0.28, report_entropy=True)
    base_cfg = PGLossConfig(clip_eps_high=0.28)
    plans = {name: plan_step(rollouts, cfg or base_cfg, PlanConfig(dp_size=dp, num_microbatches=args.microbatches,
                                                                   tp_size=args.tp))
             for name, cfg in variants.items()}

    groups = StepGroups.from_parallel_state()

    def step(name):
        cfg = variants[name]
        plan = plans[name]

        def forward_step(data_iterator, model_chunk):
            mb = next(data_iterator)
            out = model_chunk(input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=None,
                              packed_seq_params=packed_seq_params(mb))
            if cfg is None:
                return out, partial(baseline_loss_func, mb, base_cfg)
            return out, partial(pg_loss_func, mb, cfg, plan.totals, tp_group)

        optimizer.zero_grad()
        run_pg_step(model, plan, cfg or base_cfg, groups, dp_rank=dp_rank, forward_step=forward_step)
        optimizer.step()

    for name in variants:  # warm-up
        step(name)
    result = {"tp": args.tp, "dp": dp, "microbatches": args.microbatches,
              "tokens_per_rank": sum(mb.num_tokens for mb in plans["seq_mean"].for_rank(dp_rank))}
    if args.count_only:
        result["collectives"] = {name: _collectives_of(step, name) for name in variants}
    else:
        result["median_ms"] = _median_ms(step, list(variants), args.reps)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def _collectives_of(step, name: str) -> dict:
    """``{collective: calls}`` of one step of variant ``name`` (torch.distributed's functions
    wrapped for the step, then restored)."""
    import torch.distributed as dist

    counter = Counter()
    saved = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
    _count_collectives(counter)
    try:
        step(name)
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)
    return dict(counter)


def _median_ms(step, names: list, reps: int) -> dict:
    """Median step time per variant, repetitions interleaved across the variants."""
    import torch.distributed as dist

    times = {name: [] for name in names}
    for _ in range(reps):
        for name in names:
            dist.barrier()
            t0 = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) * 1e3 for name, v in times.items()}


def launch(tp: int, microbatches: int, reps: int, count_only: bool) -> dict:
    from megatron_pg_agg.megatron.torchrun import torchrun_command  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [*torchrun_command(), "--standalone", "--nproc_per_node", "2",
               os.path.abspath(__file__), "--worker", "--tp", str(tp), "--microbatches", str(microbatches),
               "--reps", str(reps), "--out", out] + (["--count-only"] if count_only else [])
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"bench_step worker failed:\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}")
        with open(out) as f:
            return json.load(f)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (2 ranks in all)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--count-only", action="store_true", help="count collectives per step, no timing")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    result = launch(args.tp, args.microbatches, args.reps, args.count_only)
    print(json.dumps(result, indent=1))
    if "median_ms" in result:
        base = result["median_ms"]["baseline (Megatron-LM token mean)"]
        print(f"\n| loss (TP={result['tp']}, DP={result['dp']}, {result['microbatches']} microbatches, "
              f"{result['tokens_per_rank']} tokens/rank) | step ms (median) | ratio to baseline |")
        print("|---|---|---|")
        for name, ms in result["median_ms"].items():
            print(f"| {name} | {ms:.1f} | {ms / base:.3f} |")


if __name__ == "__main__":
    main()

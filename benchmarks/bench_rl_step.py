"""Step time in Megatron-LM's own RL loop: the project's packed planner and loss against Megatron-LM's
own path, packed (``--rl-use-sequence-packing``) and unpacked, on the same replayed rollouts.

    python benchmarks/bench_rl_step.py --megatron-lm PATH            # CPU, 1 process, core_v0.19.x
    torchrun --nproc_per_node 8 benchmarks/bench_rl_step.py --megatron-lm PATH --gpu   # GPU lines

The three variants go through ``launch/train_rl_actor.py``'s ``main`` in this one process, in turn,
``--repeats`` times each (interleaved, Megatron-LM's globals reset between runs), on the built-in
replay set (ragged completions ending in eod): the same model, flags, rollouts and initial seed.
Every collection is one optimizer step (``--global-batch-size`` = prompts x group size) trained in
2 passes, so every variant's step trains the same tokens: the whole collection. The first
iteration of a collection also holds advantages and the old and reference log-prob passes; the
second is the step alone. An iteration's time is the wall time between consecutive ``training_log``
calls (a whole iteration: data, forward-backward, optimizer, logging; a run's first iteration,
which holds its start-up, is not timed). The ratios are median(ours) / median(Megatron-LM's) of
the step-alone iterations; the collection iterations are in the JSON summary (``--json FILE``).
The last line: ``rl step: ours/megatron-lm packed <ratio>, unpacked <ratio>``.

On a GPU (``--gpu``): bf16, Transformer Engine's spec, NCCL; the same ratios. Not run in CI.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CPU_FLAGS = ["--distributed-backend", "gloo", "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
             "--no-persist-layer-norm", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
             "--no-masked-softmax-fusion", "--no-rope-fusion", "--use-cpu-initialization"]
GPU_FLAGS = ["--bf16", "--transformer-impl", "transformer_engine", "--distributed-backend", "nccl"]


def model_flags(args) -> list:
    return ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--num-attention-heads", "4",
            "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
            "--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
            "--null-tokenizer-pad-id", "1022", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--log-interval", "1", "--seed", "1234", "--lr", "1e-4", "--min-lr", "1e-4",
            "--lr-decay-style", "constant", "--calculate-per-token-loss",
            "--grpo-prompts-per-step", str(args.prompts), "--grpo-group-size", str(args.group_size),
            "--global-batch-size", str(args.prompts * args.group_size), "--grpo-iterations", "2",
            "--train-iters", str(args.iterations), "--pg-replay-rollouts", "builtin"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megatron-lm", required=True)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=8, help="a multiple of 2 (1 step x 2 passes per collection)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from megatron_pg_agg.patches import megatron_lm_log
    from megatron_pg_agg.training import megatron_rl

    base = ["--megatron-lm", args.megatron_lm, *model_flags(args), *(GPU_FLAGS if args.gpu else CPU_FLAGS)]
    variants = {"ours (packed, token_mean, ppo)": [],
                "megatron-lm packed": ["--pg-loss-source", "megatron", "--rl-use-sequence-packing"],
                "megatron-lm unpacked": ["--pg-loss-source", "megatron"]}
    times = {name: {"collection": [], "other": []} for name in variants}
    per_collection = 2  # 1 optimizer step x 2 passes
    stamps: list = []

    def on_log(event):
        stamps.append((event.iteration, time.perf_counter()))

    for _ in range(args.repeats):
        for name, extra in variants.items():
            stamps.clear()
            megatron_lm_log.add_observer(on_log)
            try:
                status = megatron_rl.main(base + extra)
            finally:
                megatron_lm_log.remove_observer(on_log)
            assert status == 0, f"{name}: exit status {status}"
            from megatron.training.training import destroy_global_state

            destroy_global_state()
            # the first iteration of a run also holds its start-up: intervals between logs only
            for (_, previous), (iteration, stamp) in zip(stamps, stamps[1:]):
                kind = "collection" if (iteration - 1) % per_collection == 0 else "other"
                times[name][kind].append(stamp - previous)
    summary = {"device": "gpu" if args.gpu else "cpu", "config": vars(args)}
    ours_name = next(iter(variants))
    for kind in ("collection", "other"):
        medians = {name: statistics.median(t[kind]) for name, t in times.items() if t[kind]}
        summary[kind] = {"median_s": medians, "samples": {n: len(t[kind]) for n, t in times.items()},
                         "ratio_ours_over": {n: medians[ours_name] / m for n, m in medians.items() if n != ours_name}}
    text = json.dumps(summary, indent=2)
    if int(os.environ.get("RANK", "0")) == 0:
        print(text)
        if args.json:
            with open(args.json, "w") as f:
                f.write(text + "\n")
        ratios = summary["other"]["ratio_ours_over"]
        print(f"rl step: ours/megatron-lm packed {ratios['megatron-lm packed']:.2f}, "
              f"unpacked {ratios['megatron-lm unpacked']:.2f}")

if __name__ == "__main__":
    main()

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
which holds its start-up, is not timed). The ratios are median(ours) / median(Megatron-LM's), of
the step-alone iterations and of the collection iterations (the two log-prob passes and the
step). A fourth variant is ours with ``--no-pg-packed-logprobs`` (Megatron-LM's unpacked
``compute_logprobs_batch`` for the passes), in the JSON summary (``--json FILE``).

The host parts of ours' collections (the group checks, Megatron-LM's advantages and trajectories,
the cut into steps, planning, the row positions of the packed passes) are timed by wrapping those
functions, per collection; ``--host-scaling 8,32,128`` also times them alone at those prompt counts
(one collection each, a 1-layer model: only the host parts are read there).
The last line: ``rl step: ours/megatron-lm packed <ratio>, unpacked <ratio>; collection: packed
<ratio>, unpacked <ratio>``.

On a GPU (``--gpu``): bf16, Transformer Engine's spec, NCCL; the same ratios. Not run in CI.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from unittest import mock

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


class HostParts:
    """Wall time of the host parts of ours' collections, summed by name while :meth:`timing` is on
    (the step plans run on the plan-ahead thread, beside the step before them: their time counts
    here but is mostly hidden from the iteration)."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.collections = 0
        self.on = False

    def _wrap(self, name: str, fn, *, returns_pass: bool = False):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
            return self._wrap("log-prob passes (forward)", out) if returns_pass else out
        return timed

    def patches(self):
        from megatron_pg_agg.training import rl_collection

        planner = rl_collection.CollectionPlanner
        call = planner.__call__

        def collection(this, **kwargs):
            from megatron.rl import rl_utils  # imported by now (Megatron-LM's loop calls this)

            if self.on:
                self.collections += 1
            with contextlib.ExitStack() as inner:
                for name, label in (("compute_group_stats", "advantages (Megatron-LM's compute_group_stats)"),
                                    ("prepare_trajectories", "trajectories (Megatron-LM's prepare_trajectories)")):
                    inner.enter_context(mock.patch.object(rl_utils, name, self._wrap(label, getattr(rl_utils, name))))
                return self._wrap("collection (all)", call)(this, **kwargs)

        stack = contextlib.ExitStack()
        for target, name, label in (
                (planner, "_check_groups", "group checks"),
                (rl_collection, "step_batches", "cut into steps (step_batches)"),
                (rl_collection, "plan_step", "planning (plan_step: the passes' layout, the steps)"),
                (rl_collection, "row_positions", "row positions of the packed passes"),
                (rl_collection, "_host_copy", "weight copies for the reference swap (_host_copy)")):
            stack.enter_context(mock.patch.object(target, name, self._wrap(label, getattr(target, name))))
        for name in ("packed_logprob_pass", "make_logprob_pass"):
            stack.enter_context(mock.patch.object(rl_collection, name, self._wrap(
                f"log-prob passes (building: {name})", getattr(rl_collection, name), returns_pass=True)))
        stack.enter_context(mock.patch.object(planner, "__call__", collection))
        return stack

    def per_collection_ms(self) -> dict:
        return {name: 1e3 * s / max(self.collections, 1) for name, s in sorted(self.seconds.items())}

    def reset(self) -> None:
        self.seconds.clear()
        self.collections = 0


def host_scaling(args, base_flags, prompt_counts: list) -> dict:
    """The host parts of one collection alone, at each prompt count (a 1-layer model)."""
    from megatron.training.training import destroy_global_state

    from megatron_pg_agg.training import megatron_rl

    out = {}
    small = argparse.Namespace(**{**vars(args), "layers": 1, "hidden": 64, "iterations": 2})
    for prompts in prompt_counts:
        small.prompts = prompts
        flags = ["--megatron-lm", args.megatron_lm, *model_flags(small), *base_flags]
        parts = HostParts()
        with parts.patches():
            parts.on = True
            status = megatron_rl.main(flags)
        destroy_global_state()
        assert status == 0, f"host scaling at {prompts} prompts: exit status {status}"
        out[prompts] = {"sequences": prompts * args.group_size, "ms": parts.per_collection_ms()}
    return out


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
    parser.add_argument("--host-scaling", default=None, metavar="P1,P2,...",
                        help="also time the host parts of one collection alone at these prompt counts")
    args = parser.parse_args()

    from megatron_pg_agg.patches import megatron_lm_log
    from megatron_pg_agg.training import megatron_rl

    base = ["--megatron-lm", args.megatron_lm, *model_flags(args), *(GPU_FLAGS if args.gpu else CPU_FLAGS)]
    variants = {"ours (packed, token_mean, ppo)": [],
                "megatron-lm packed": ["--pg-loss-source", "megatron", "--rl-use-sequence-packing"],
                "megatron-lm unpacked": ["--pg-loss-source", "megatron"],
                "ours, unpacked log-prob passes": ["--no-pg-packed-logprobs"]}
    ours_name = next(iter(variants))
    parts = HostParts()
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
                with parts.patches():
                    parts.on = name == ours_name
                    status = megatron_rl.main(base + extra)
            finally:
                parts.on = False
                megatron_lm_log.remove_observer(on_log)
            assert status == 0, f"{name}: exit status {status}"
            from megatron.training.training import destroy_global_state

            destroy_global_state()
            # the first iteration of a run also holds its start-up: intervals between logs only
            for (_, previous), (iteration, stamp) in zip(stamps, stamps[1:]):
                kind = "collection" if (iteration - 1) % per_collection == 0 else "other"
                times[name][kind].append(stamp - previous)
    summary = {"device": "gpu" if args.gpu else "cpu", "config": vars(args)}
    for kind in ("collection", "other"):
        medians = {name: statistics.median(t[kind]) for name, t in times.items() if t[kind]}
        summary[kind] = {"median_s": medians, "samples": {n: len(t[kind]) for n, t in times.items()},
                         "ratio_ours_over": {n: medians[ours_name] / m for n, m in medians.items() if n != ours_name}}
    summary["host_ms_per_collection"] = parts.per_collection_ms()
    if args.host_scaling:
        summary["host_scaling"] = host_scaling(args, GPU_FLAGS if args.gpu else CPU_FLAGS,
                                               [int(p) for p in args.host_scaling.split(",")])
    text = json.dumps(summary, indent=2)
    if int(os.environ.get("RANK", "0")) == 0:
        print(text)
        if args.json:
            with open(args.json, "w") as f:
                f.write(text + "\n")
        step, whole = summary["other"]["ratio_ours_over"], summary["collection"]["ratio_ours_over"]
        print(f"rl step: ours/megatron-lm packed {step['megatron-lm packed']:.2f}, "
              f"unpacked {step['megatron-lm unpacked']:.2f}; collection: packed {whole['megatron-lm packed']:.2f}, "
              f"unpacked {whole['megatron-lm unpacked']:.2f}")

if __name__ == "__main__":
    main()

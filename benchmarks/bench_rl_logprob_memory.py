"""Peak memory of the RL entry's old log-prob pass, packed and unpacked, against one training step.

    python benchmarks/bench_rl_logprob_memory.py --megatron-lm PATH      # CPU, 1 process, core_v0.19.x

Each variant runs ``launch/train_rl_actor.py``'s ``main`` (one collection: one optimizer step of
the whole collection, 2 passes) in a fresh interpreter and measures, with the resident set's
high-water mark reset first (benchmarks/_peak.py):

* ``old pass``: the extra peak of the collection's old log-prob pass, the whole pass (the packed
  forward-only pass over the planner's THD microbatches, ``--pg-packed-logprobs``, or Megatron-LM's
  ``compute_logprobs_batch`` on rows of ``--seq-length``, ``--no-pg-packed-logprobs``), its
  ``[N, S-1]`` rows included;
* ``training step``: the extra peak of the first optimizer step's forward-backward schedule call
  (every microbatch forward and backward; one microbatch's activations at a time, at the same
  capacity, ``--seq-length``).

The packed pass must not exceed the training step: forward-only, each microbatch's logits dropped
after its log-prob gather. The built-in replay set holds trajectories of at most 48 tokens, so a
packed microbatch holds about ``--seq-length`` real tokens where an unpacked row holds one
sequence padded to ``--seq-length``: both forward ``--seq-length`` tokens at a time.
Last line: ``rl log-prob pass peak MiB: packed <p>, unpacked <u>; training step <t>``.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def flags(args) -> list:
    return ["--megatron-lm", args.megatron_lm,
            "--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--num-attention-heads", "4",
            "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
            "--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(args.vocab),
            "--null-tokenizer-pad-id", str(args.vocab - 2), "--hidden-dropout", "0", "--attention-dropout", "0",
            "--log-interval", "1", "--seed", "1234", "--lr", "1e-4", "--min-lr", "1e-4",
            "--lr-decay-style", "constant", "--calculate-per-token-loss",
            "--grpo-prompts-per-step", str(args.prompts), "--grpo-group-size", str(args.group_size),
            "--global-batch-size", str(args.prompts * args.group_size), "--grpo-iterations", "2",
            "--train-iters", "2", "--pg-replay-rollouts", "builtin",
            "--distributed-backend", "gloo", "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
            "--no-persist-layer-norm", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
            "--no-masked-softmax-fusion", "--no-rope-fusion", "--use-cpu-initialization"]


def child(argv: list) -> dict:
    """One run in this interpreter: ``{"old pass": bytes, "training step": bytes}``."""
    from unittest import mock

    from _peak import extra_peak_bytes
    from megatron.core.pipeline_parallel import schedules

    from megatron_pg_agg.training import megatron_rl, rl_collection

    peaks = {}

    def measured_pass(build):
        def wrapper(*a, **k):
            logprobs = build(*a, **k)
            calls = []

            def first_measured():
                if calls:  # the reference pass: not measured
                    return logprobs()
                out = []
                peaks["old pass"] = extra_peak_bytes(lambda: out.append(logprobs()))
                calls.append(1)
                return out[0]
            return first_measured
        return wrapper

    original = schedules.forward_backward_no_pipelining

    @functools.wraps(original)  # the RL entry's schedule wrapper binds the schedule's own signature
    def measured_schedule(*a, **k):
        if k.get("forward_only") or "training step" in peaks:
            return original(*a, **k)
        out = []
        peaks["training step"] = extra_peak_bytes(lambda: out.append(original(*a, **k)))
        return out[0]

    with mock.patch.object(rl_collection, "packed_logprob_pass", measured_pass(rl_collection.packed_logprob_pass)), \
            mock.patch.object(rl_collection, "make_logprob_pass", measured_pass(rl_collection.make_logprob_pass)), \
            mock.patch.object(schedules, "forward_backward_no_pipelining", measured_schedule):
        status = megatron_rl.main(argv)
    assert status == 0, status
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megatron-lm", required=True)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", choices=("packed", "unpacked"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, HERE)
        sys.path.insert(0, ROOT)
        extra = ["--no-pg-packed-logprobs"] if args.child == "unpacked" else []
        print("PEAKS " + json.dumps(child(flags(args) + extra)))
        return
    rows = {}
    for name in ("packed", "unpacked"):
        env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": os.environ.get("MASTER_PORT", "29517")}
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", name]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = [x for x in proc.stdout.splitlines() if x.startswith("PEAKS ")]
        if proc.returncode or not line:
            raise SystemExit(f"{name}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-4000:]}")
        rows[name] = json.loads(line[-1][len("PEAKS "):])
        print(f"{name}: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in rows[name].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "peak_bytes": rows}, f, indent=1)
    mib = {name: r["old pass"] / 2**20 for name, r in rows.items()}
    step = max(r["training step"] for r in rows.values()) / 2**20
    print(f"rl log-prob pass peak MiB: packed {mib['packed']:.1f}, unpacked {mib['unpacked']:.1f}; "
          f"training step {step:.1f}")


if __name__ == "__main__":
    main()

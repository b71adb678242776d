"""The first whole training runs on one GPU (issue 52): the trainer, Megatron-LM's pretrain() and its RL
loop, and MoE, in one command that ends within 8 minutes, with a CPU dry run that takes the same paths.

    python benchmarks/gpu_e2e.py --megatron-lm PATH --json OUT.json             # one GPU: NCCL, bf16
    python benchmarks/gpu_e2e.py --dry-run --megatron-lm PATH --json OUT.json   # CPU, gloo, tiny sizes

Every check runs in a process of its own (``torchrun --nproc_per_node 1``) under its own time limit
(:data:`LIMITS_S`: 420 s in all on the GPU); a check that fails or runs out of time is recorded with
its error and the tail of its output, and the next one runs. Rank 0 of each writes its numbers as it
goes, so a check stopped half-way keeps what it measured. Every run uses ``--bf16
--use-distributed-optimizer --overlap-grad-reduce`` (NCCL on the GPU, gloo on CPU) and the local
spec (``--transformer-impl local``: no Transformer Engine on the GPU machine, see below).

a. The trainer (``megatron_pg_agg.online.cli.main``, launch/train_actor.py's ``main``) on one rollout
   file, every mode, one step cut three ways (``--num-microbatches 1``, ``--num-microbatches 3``,
   ``--max-tokens-per-microbatch N``): the objective and gradient norm of each run from its metrics
   JSONL, their spread over the splits, and beside them the control: Megatron's default averaging
   of a per-microbatch sequence mean (for each split, the mean over microbatches of each
   microbatch's own seq_mean objective, each microbatch's sequences planned as a step of their own
   through the same step runner at the same initial weights, and the norm of the mean of their
   gradients). The same session also runs our whole seq_mean step per split (``ours_in_session``)
   to show the control ran at the trainer's weights.
b. Throughput: a GPT of about 335M parameters (24 layers, hidden 1024, vocabulary 32000) built by
   the trainer's own ``setup`` from its flags, a step of 44k tokens packed THD in microbatches of
   at most 4096 (the local spec's attention builds a [T, T] mask per microbatch, so a microbatch
   stays at 4k). Step time (forward-backward through the project's step runner, then the
   optimizer) for each mode, for the loss as the trainer runs it (entropy reported), against two
   plain losses through the same runner: Megatron's own GPT loss (the model's masked per-token
   cross entropy, summed: ``pretrain_gpt.py``'s loss) and bench_step.py's baseline (megatron-core's
   ``vocab_parallel_cross_entropy``, the same PPO clip, masked token sum). Repetitions interleaved,
   medians; tokens/s = the step's tokens / its median time. The host planner (``plan_step``) is
   timed alone per mode against the GPU step; then the trainer's own ``train_step`` runs a few
   iterations with ``--pg-plan-ahead`` and the time it waited for its plan is recorded (the
   planner is off the critical path when that wait is ~0).
c. Megatron-LM's ``pretrain()`` (launch/pretrain_actor.py, a core_v0.15-0.19 checkout given by
   ``--megatron-lm``) with ``--pg-loss-aggregation prompt_mean``, 20 iterations on a rollout file;
   and Megatron-LM's RL loop (bench_rl_step.py, gpu_check.py's check 5, with the local spec instead
   of Transformer Engine: its step and collection times, ours against Megatron-LM's packed and
   unpacked paths; megatron-core 0.19 only, skipped with the reason elsewhere).
d. MoE (4 experts, top-2, aux 0.01, z 1e-3), one GPU: the router aux/z gradient with the
   ``moe_aux_loss`` patch against Megatron's default averaging (fp32, advantages 0, every mode:
   ``factor`` must be 1), the unpatched control (off by about tokens / W), then the trainer with
   ``--num-experts 4 --moe-router-topk 2`` in every mode under the production flags.

The JSON: the device, torch, megatron-core, Python, the package's location (and whether it matches
this working tree), each check's status, seconds, limit and numbers, and a suggested file name for
``benchmarks/results/`` (``<card>-<date>.json``). Exit status 1 if a check failed or timed out.

Carrying what the GPU machine lacks (Python 3.12.3, torch 2.11.0+cu130; no megatron-core,
Transformer Engine, apex or pydantic; no network: ../shared/notes/gpu-device.md). Here, from the
repository root, once per change of the code (two ignored folders travel with the working tree):

    grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
    grep -qx '/.mlm/' .git/info/exclude || echo /.mlm/ >> .git/info/exclude
    rm -rf .whl .mlm && mkdir .whl
    .venv312/bin/pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
      --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
      --platform manylinux2014_x86_64 -d .whl megatron-core==0.19.2 pydantic==2.14.4 pydantic-core==2.50.5 \\
      annotated-types==0.8.0 typing-inspection==0.4.5 tensorboard==2.21.0 protobuf==7.36.2 absl-py==2.5.1 \\
      wandb==0.31.0 click==8.5.1 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \\
      opentelemetry-semantic-conventions==0.66b2 xxhash==4.1.0 openai==3.63.0 httpx2==2.17.0 httpcore2==2.17.0 \\
      fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 uvicorn==0.55.0
    .venv312/bin/pip wheel --no-deps --no-build-isolation -w .whl .     # this package (patches/ inside)
    cp -r ../shared/third_party/Megatron-LM-core_v0.19.0 .mlm && du -sh .whl .mlm

(pydantic and its two: Megatron-LM's training side; the rest: Megatron-LM's RL loop, whose rl_utils
imports torch.utils.tensorboard and wandb at its top and whose inference and server modules import
openai, fastapi and uvicorn. That is what an import check of the trainer, the pretrain path and the
RL loop showed missing in a Python 3.12 venv holding only the GPU machine's packages (torch and its
dependencies with setuptools, numpy, pyyaml, regex, six, psutil, httpx, tqdm, pytest); the dry run
passes in that venv with these installed as above. Carried: the wheels 34.2 MiB (wandb 19.4 of it),
.mlm 1.9 MB, the working tree 2.8 MB: about 39 MiB of the 64.)

Then one ``run`` call, carry ``[".whl", ".mlm"]``, ``timeout_s`` 600 (the command is 190 characters):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \\
      PYTHONPATH=/tmp/site timeout 540 python3 benchmarks/gpu_e2e.py --megatron-lm .mlm \\
      --json $OUT/gpu_e2e.json

Transformer Engine cannot travel (a 276 MB wheel, and a source package to compile against the
machine's torch), so this first run is the local spec's: its THD attention is the project's
``ThdDotProductAttention`` (a masked O(T^2) attention, not a fused kernel), the same in ours and
in every baseline.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODES = ("token_mean", "seq_mean", "prompt_mean", "constant")
CHECKS = ("a", "b", "c_pretrain", "c_rl", "d")
PROD = ["--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce"]
"""The production flags every run here uses (Megatron-LM's meanings, in the trainer and the entries)."""
LIMITS_S = {"gpu": {"a": 90, "b": 120, "c_pretrain": 60, "c_rl": 90, "d": 60},
            "dry": {"a": 150, "b": 120, "c_pretrain": 150, "c_rl": 150, "d": 120}}
"""Each check's time limit (seconds): 420 s in all on the GPU, inside one 540 s command."""
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "1e-3",
       "--moe-token-dispatcher-type", "alltoall", "--num-microbatches", "3"]
MLM_LOCAL = ["--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
             "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-masked-softmax-fusion", "--no-rope-fusion"]
"""Megatron-LM's flags for the local spec without apex or Transformer Engine (the fusions that need
them off; the jit fusions off too, so that no torch.compile runs inside the time limit)."""
MLM_BACKEND = {"gpu": ["--distributed-backend", "nccl"],
               "dry": ["--distributed-backend", "gloo", "--use-cpu-initialization"]}

_DRY_GPT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "128",
            "--max-position-embeddings", "256"]
"""The dry run's trainer model (checks a and b)."""

SIZES = {
    "gpu": {
        "a": {"model": ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
                        "--vocab-size", "32000", "--max-position-embeddings", "4096"],
              "rollouts": {"groups": 16, "group_size": 4, "prompt": [16, 64], "response": [16, 240],
                           "vocab": 32000, "seed": 52},
              "cap": 2048},
        "b": {"model": ["--num-layers", "24", "--hidden-size", "1024", "--ffn-hidden-size", "4096",
                        "--num-attention-heads", "16", "--vocab-size", "32000", "--max-position-embeddings", "4096"],
              "rollouts": {"groups": 16, "group_size": 8, "prompt": [32, 160], "response": [32, 480],
                           "vocab": 32000, "seed": 53},
              "cap": 4096, "reps": 5, "plan_reps": 5, "trainer_iters": 4},
        "c_pretrain": {"model": ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
                                 "--seq-length", "4096", "--max-position-embeddings", "4096", "--vocab-size", "32000"],
                       "global_batch": 4},
        "c_rl": ["--layers", "4", "--hidden", "1024", "--seq-length", "1024", "--prompts", "8", "--group-size", "8",
                 "--iterations", "6", "--repeats", "1"],
        "d": {"model": ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
                        "--vocab-size", "128"]},
    },
    "dry": {
        "a": {"model": _DRY_GPT,
              "rollouts": {"groups": 6, "group_size": 4, "prompt": [3, 10], "response": [4, 28],
                           "vocab": 128, "seed": 52},
              "cap": 64},
        "b": {"model": _DRY_GPT,
              "rollouts": {"groups": 8, "group_size": 4, "prompt": [3, 10], "response": [4, 40],
                           "vocab": 128, "seed": 53},
              "cap": 128, "reps": 2, "plan_reps": 3, "trainer_iters": 3},
        "c_pretrain": {"model": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                 "--seq-length", "256", "--max-position-embeddings", "256", "--vocab-size", "128"],
                       "global_batch": 4},
        "c_rl": ["--layers", "1", "--hidden", "64", "--seq-length", "128", "--prompts", "4", "--group-size", "2",
                 "--iterations", "4", "--repeats", "1"],
        "d": {"model": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                        "--vocab-size", "128"]},
    },
}
"""What each check runs at each profile. The dry run takes the same code paths at tiny sizes."""


def mode_flags(mode: str) -> list:
    return ["--pg-loss-aggregation", mode, *(["--pg-loss-aggregation-divisor", "64"] if mode == "constant" else [])]


def make_rollouts(*, groups: int, group_size: int, prompt: list, response: list, vocab: int, seed: int) -> list:
    """A deterministic GRPO-like step (``Rollout`` list, groups consecutive): ragged prompts and
    responses, reward = share of even token ids, advantages normalised per group, old log-probs
    near uniform, 5% of tokens masked and 5% more filtered from the numerator."""
    from megatron_pg_agg.data.rollouts import Rollout

    rng = random.Random(seed)
    uniform = -math.log(vocab)
    out = []
    for g in range(groups):
        prompt_ids = [rng.randrange(vocab) for _ in range(rng.randint(*prompt))]
        responses = [[rng.randrange(vocab) for _ in range(rng.randint(*response))] for _ in range(group_size)]
        rewards = [sum(1 for t in r if t % 2 == 0) / len(r) for r in responses]
        mean = sum(rewards) / len(rewards)
        std = (sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5
        for resp, reward in zip(responses, rewards):
            mask = [1 if rng.random() > 0.05 else 0 for _ in resp]
            out.append(Rollout(prompt_ids=prompt_ids, response_ids=resp, loss_mask=mask,
                               advantages=[(reward - mean) / (std + 1e-4)] * len(resp),
                               old_logprobs=[uniform + rng.uniform(-0.05, 0.05) for _ in resp],
                               numerator_mask=[m if rng.random() > 0.05 else 0 for m in mask], group_id=f"g{g}"))
    return out


def spread(values: list, floor: float = 0.01) -> float:
    """(max - min) / max(|mean|, floor): the project's split spread (test_production_config.py)."""
    values = [float(v) for v in values]
    return (max(values) - min(values)) / max(abs(sum(values) / len(values)), floor)


# ----------------------------------------------------------------------------- worker side


class Out:
    """A worker's result, rewritten whole after every part (a check stopped half-way keeps what
    it measured). ``errors``: a part that raised, with its traceback."""

    def __init__(self, path: str):
        self.path, self.data = path, {}

    def put(self, key: str, value) -> None:
        self.data[key] = value
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=float)
        os.replace(tmp, self.path)

    def part(self, name: str, fn):
        """``fn()`` stored under ``name``; an exception is stored under ``errors`` (the process
        group it may have left is released) and None returned."""
        try:
            value = fn()
        except Exception:
            from megatron_pg_agg.training.worker_process import release_process_group

            release_process_group()
            self.put("errors", {**self.data.get("errors", {}), name: traceback.format_exc()[-6000:]})
            print(f"[gpu_e2e] part {name} FAILED:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            return None
        self.put(name, value)
        return value


def fresh_rendezvous() -> None:
    """A new local rendezvous for the next process group of this one-rank worker: every run makes
    and destroys its own group, and a new group on torchrun's store would read the old one's keys."""
    from megatron_pg_agg.megatron.parallel import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), TORCHELASTIC_USE_AGENT_STORE="False")


def trainer_run(argv: list, metrics: str) -> dict:
    """One trainer run through its command line's ``main`` (exit status, the first step's record)."""
    from megatron_pg_agg.online.cli import main
    from megatron_pg_agg.training.metrics import read_runs

    fresh_rendezvous()
    status = main([*argv, "--metrics-file", metrics])
    steps = read_runs(metrics)[-1].steps if status == 0 and os.path.exists(metrics) else []
    keep = ("objective", "grad_norm", "weight", "valid_tokens", "tokens_per_s", "step_s", "microbatches",
            "moe_aux_loss", "moe_z_loss")
    return {"status": status, "iterations": len(steps), **{k: steps[0].get(k) for k in keep if steps and k in steps[0]}}


def session(argv: list, steps=None):
    """The trainer's own ``setup`` (patches, process group, model, optimizer, plan-ahead) for ``argv``."""
    from megatron_pg_agg.training import trainer
    from megatron_pg_agg.training.run_config import RunConfig, parse_flags

    fresh_rendezvous()
    cfg = RunConfig.from_args(parse_flags(argv))
    return cfg, trainer.setup(cfg, steps, data="gpu_e2e" if steps is not None else None)


def sync(s) -> None:
    if s.device is not None:
        import torch

        torch.cuda.synchronize()


def runner_step(s, plan, loss_cfg, *, forward_step=None, optimizer: bool = True):
    """One step through the project's step runner (``run_pg_step``), then the optimizer."""
    from megatron_pg_agg.megatron.step import run_pg_step

    s.optimizer.zero_grad()
    result = run_pg_step(s.model, plan, loss_cfg, s.groups, dp_rank=0, experts=s.experts, device=s.device,
                         forward_step=forward_step)
    if optimizer:
        s.optimizer.step()
    return result


def whole_main_grad(s):
    """Every parameter's main gradient (fp32, the whole gradient on one rank), flattened."""
    import torch

    return torch.cat([p.main_grad.detach().float().flatten() for chunk in s.model for p in chunk.parameters()
                      if getattr(p, "main_grad", None) is not None])


# ----------------------------------------------------------------------------- a: the trainer


def check_a(spec: dict, out: Out) -> None:
    from megatron_pg_agg.data.rollout_files import write_rollouts

    rollouts = make_rollouts(**spec["rollouts"])
    path = os.path.join(spec["dir"], "a-rollouts.jsonl")
    write_rollouts(path, {0: rollouts})
    base = ["--rollouts", path, *spec["model"], *PROD, "--train-iters", "1", "--lr", "1e-4"]
    splits = {"1mb": ["--num-microbatches", "1"], "3mb": ["--num-microbatches", "3"],
              f"cap{spec['cap']}": ["--max-tokens-per-microbatch", str(spec["cap"])]}
    out.put("splits", splits)
    runs = {}
    for mode in MODES:
        for split, flags in splits.items():
            runs.setdefault(mode, {})[split] = trainer_run([*base, *mode_flags(mode), *flags],
                                                           os.path.join(spec["dir"], f"a-{mode}-{split}.jsonl"))
            out.put("runs", runs)
    done = {m: r for m, r in runs.items() if all(x["status"] == 0 for x in r.values())}
    out.put("spread", {m: {"objective": spread([x["objective"] for x in r.values()]),
                           "grad_norm": spread([x["grad_norm"] for x in r.values()], floor=1e-30)}
                       for m, r in done.items()})
    control = out.part("control", lambda: seq_mean_control([*base, *mode_flags("seq_mean")], splits, rollouts))
    if control:
        per = control["per_split"]
        out.put("control_spread", {"objective": spread([v["objective"] for v in per.values()]),
                                   "grad_norm": spread([v["grad_norm"] for v in per.values()], floor=1e-30)})


def seq_mean_control(argv: list, splits: dict, rollouts: list) -> dict:
    """Megatron's default averaging of a per-microbatch sequence mean, on the trainer's splits of the
    step at its initial weights (no optimizer step): each microbatch's sequences planned as a step
    of their own (one microbatch) through the step runner; the objective is the mean of theirs, the
    gradient the mean of theirs. ``ours_in_session``: our whole seq_mean step on the same split."""
    import torch

    from megatron_pg_agg.data.planner import PlanConfig, canonical_order, plan_step
    from megatron_pg_agg.training import trainer
    from megatron_pg_agg.training.run_config import RunConfig, parse_flags

    cfg, s = session(argv)
    batch, per_split = s.steps[0], {}
    for split, flags in splits.items():
        plan_cfg = RunConfig.from_args(parse_flags([*argv, *flags])).plan_config(1)
        plan = plan_step(batch, cfg.loss, plan_cfg)
        order = canonical_order(batch, plan_cfg).order.tolist()
        ours = runner_step(s, plan, cfg.loss, optimizer=False).values(plan.totals.pg_weight)["objective"]
        ours_norm = float(whole_main_grad(s).double().norm())
        objectives, grad_sum = [], None
        for mb in plan.for_rank(0):
            members = [rollouts[order[int(i)]] for i in mb.sequence_ids]
            own = plan_step(members, cfg.loss, PlanConfig(dp_size=1, num_microbatches=1))
            result = runner_step(s, own, cfg.loss, optimizer=False)
            objectives.append(result.values(own.totals.pg_weight)["objective"])
            grad = whole_main_grad(s).double()
            grad_sum = grad if grad_sum is None else grad_sum + grad
        per_split[split] = {"microbatches": len(objectives), "objective": sum(objectives) / len(objectives),
                            "grad_norm": float(torch.linalg.vector_norm(grad_sum / len(objectives))),
                            "ours_in_session": {"objective": ours, "grad_norm": ours_norm}}
    trainer.close(s, {})
    return {"per_split": per_split}


# ----------------------------------------------------------------------------- b: throughput


def megatron_gpt_loss(mb, output_tensor):
    """pretrain_gpt.py's loss: the model's per-token cross entropy (given labels), masked and summed."""
    import torch

    losses = output_tensor.float().reshape(-1)
    mask = mb.denominator_mask
    loss = torch.where(mask, losses, 0.0).sum()
    count = mask.sum().to(torch.int32)
    return loss, count, {"lm loss": torch.stack([loss.detach(), count.float()])}


def baseline_forward_step(kind: str, base_cfg, device):
    """A forward step of a plain loss through the same runner: ``"gpt"`` (Megatron's own GPT loss:
    the model computes the cross entropy from labels) or ``"ppo"`` (bench_step.py's baseline)."""
    from bench_step import baseline_loss_func

    from megatron_pg_agg.megatron.loss_func import packed_seq_params

    def forward_step(data_iterator, model_chunk):
        mb = next(data_iterator)
        if device is not None:
            mb = mb.to(device)
        extra = {"labels": mb.labels} if kind == "gpt" else {}
        out = model_chunk(input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=None,
                          packed_seq_params=packed_seq_params(mb), **extra)
        loss = partial(megatron_gpt_loss, mb) if kind == "gpt" else partial(baseline_loss_func, mb, base_cfg)
        return out, loss

    return forward_step


def check_b(spec: dict, out: Out) -> None:
    import dataclasses

    import torch

    from megatron_pg_agg.data.planner import plan_step
    from megatron_pg_agg.data.rollouts import RolloutBatch

    rollouts = make_rollouts(**spec["rollouts"])
    batch = RolloutBatch.from_rollouts(rollouts, vocab_size=spec["rollouts"]["vocab"])
    argv = ["--rollouts", "synthetic", *spec["model"], *PROD, *mode_flags("token_mean"), "--lr", "1e-5",
            "--max-tokens-per-microbatch", str(spec["cap"]), "--train-iters", str(spec["trainer_iters"])]
    cfg, s = session(argv, steps={0: batch})
    params = sum(p.numel() for chunk in s.model for p in chunk.parameters())
    losses = {m: dataclasses.replace(cfg.loss, mode=m, divisor=64.0 if m == "constant" else None,
                                     report_entropy=False) for m in MODES}
    losses["token_mean, the trainer's loss (entropy reported)"] = cfg.loss
    plans = {name: plan_step(batch, loss, s.plan_cfg) for name, loss in losses.items()}
    first = plans["token_mean"]
    out.put("step", {"parameters": params, "tokens": first.stats["tokens"], "padded_tokens": first.stats["padded_tokens"],
                     "sequences": first.stats["sequences"], "microbatches": first.stats["microbatches_per_rank"],
                     "microbatch_tokens_max": max(first.bin_tokens[0]), "cap": spec["cap"]})
    variants = {"megatron gpt loss": (first, cfg.loss, baseline_forward_step("gpt", cfg.loss, s.device)),
                "bench_step baseline": (first, cfg.loss, baseline_forward_step("ppo", cfg.loss, s.device)),
                **{name: (plans[name], loss, None) for name, loss in losses.items()}}
    times = out.part("step_times_s", lambda: interleaved_times(s, variants, spec["reps"]))
    if times:
        out.put("throughput", throughput(times, first.stats["tokens"]))
    out.part("planner_ms", lambda: planner_times(batch, losses, s.plan_cfg, spec["plan_reps"], plan_step))
    out.part("trainer_steps", lambda: trainer_steps(s, spec["trainer_iters"]))
    if s.device is not None:
        out.put("max_memory_gib", torch.cuda.max_memory_allocated() / 2**30)


def interleaved_times(s, variants: dict, reps: int) -> dict:
    """Seconds per step of each variant: one warm-up round, then ``reps`` rounds, the order rotated
    each round; synchronised before and after each step."""
    names = list(variants)
    times = {name: [] for name in names}
    for rep in range(reps + 1):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            plan, loss_cfg, forward_step = variants[name]
            sync(s)
            t0 = time.perf_counter()
            runner_step(s, plan, loss_cfg, forward_step=forward_step)
            sync(s)
            if rep:
                times[name].append(time.perf_counter() - t0)
    return times


def throughput(times: dict, tokens: int) -> dict:
    """Median step, tokens/s and the ratios against both plain losses (tokens/s ours / theirs)."""
    median = {name: statistics.median(t) for name, t in times.items()}
    rows = {}
    for name, m in median.items():
        rows[name] = {"median_step_s": m, "tokens_per_s": tokens / m,
                      "vs_megatron_gpt_loss": median["megatron gpt loss"] / m,
                      "vs_bench_step_baseline": median["bench_step baseline"] / m}
    return rows


def planner_times(batch, losses: dict, plan_cfg, reps: int, plan_step) -> dict:
    """The host planner alone (``plan_step`` of the whole step), median ms per mode."""
    out = {}
    for name, loss in losses.items():
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            plan_step(batch, loss, plan_cfg)
            samples.append(time.perf_counter() - t0)
        out[name] = 1e3 * statistics.median(samples)
    return out


def trainer_steps(s, iters: int) -> dict:
    """The trainer's own ``train_step`` with ``--pg-plan-ahead``: its records, and how long each
    iteration waited for its plan (built on the host thread while the step before it ran)."""
    from megatron_pg_agg.training import trainer

    waits, get = [], s.plans.get

    def timed_get(iteration):
        t0 = time.perf_counter()
        try:
            return get(iteration)
        finally:
            waits.append(time.perf_counter() - t0)

    s.plans.get = timed_get
    records = [trainer.train_step(s) for _ in range(iters)]
    trainer.close(s, dict(records[-1]))
    return {"step_s": [r["step_s"] for r in records], "tokens_per_s": [r["tokens_per_s"] for r in records],
            "plan_wait_ms": [1e3 * w for w in waits], "objective": [r["objective"] for r in records]}


# ----------------------------------------------------------------------------- c: Megatron-LM's RL loop


def check_c_rl(spec: dict, out: Out) -> None:
    """bench_rl_step.py in this process, with the local spec's flags in place of its GPU flags."""
    import importlib

    import megatron_pg_agg.patches  # noqa: F401  (the installed package first: bench_rl_step puts the tree on sys.path)

    bench_rl_step = importlib.import_module("bench_rl_step")

    bench_rl_step.GPU_FLAGS = ["--bf16", *MLM_BACKEND["gpu"], *MLM_LOCAL, *PROD[1:]]
    bench_rl_step.CPU_FLAGS = [*MLM_BACKEND["dry"], *MLM_LOCAL, *PROD]
    path = os.path.join(spec["dir"], "rl.json")
    sys.argv = ["bench_rl_step.py", "--megatron-lm", spec["megatron_lm"], *(["--gpu"] if spec["gpu"] else []),
                *spec["argv"], "--json", path]
    out.put("argv", sys.argv[1:])
    out.put("flags", bench_rl_step.GPU_FLAGS if spec["gpu"] else bench_rl_step.CPU_FLAGS)
    bench_rl_step.main()
    with open(path) as f:
        result = json.load(f)
    out.put("bench", {k: result[k] for k in ("collection", "other", "host_ms_per_collection") if k in result})


# ----------------------------------------------------------------------------- d: MoE


def check_d(spec: dict, out: Out) -> None:
    out.part("strength", moe_strength)
    runs = {}
    for mode in MODES:
        runs[mode] = trainer_run(["--rollouts", "synthetic", *spec["model"], *PROD, *MOE, *mode_flags(mode),
                                  "--train-iters", "2"], os.path.join(spec["dir"], f"d-{mode}.jsonl"))
        out.put("trainer_runs", runs)
    aux = [r["moe_aux_loss"][0] / r["moe_aux_loss"][1] for r in runs.values() if r.get("moe_aux_loss")]
    if len(aux) == len(MODES):
        out.put("trainer_aux_loss_spread", spread(aux, floor=1e-30))


class MoeTwins:
    """A tiny MoE GPT (4 experts, top-2, aux 0.01, z 1e-3, 2 layers, fp32) built twice with the same
    weights: the project's per-token contract and Megatron's default averaging (as
    tests/distributed/workers/moe_worker.py, on this process's device)."""

    def __init__(self, cuda: bool):
        import torch
        from megatron.core.distributed import finalize_model_grads

        from megatron_pg_agg.megatron.model import build_model_chunks, default_ddp_config, wrap_in_ddp
        from megatron_pg_agg.parity import VOCAB
        from megatron_pg_agg.parity.models import tiny_transformer_config

        self.cuda, self.models, state = cuda, {}, None
        for per_token in (True, False):
            config = tiny_transformer_config(
                num_layers=2, calculate_per_token_loss=per_token, num_moe_experts=4, moe_router_topk=2,
                moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3, moe_token_dispatcher_type="alltoall",
                add_bias_linear=False, params_dtype=torch.float32, pipeline_dtype=torch.float32,
                # a GPU's settings turn the gelu bias fusion on, which megatron-core refuses without
                # linear biases (the trainer's MoE models hit the same refusal on a GPU)
                bias_activation_fusion=False)
            torch.manual_seed(1234)
            chunks = build_model_chunks(config, VOCAB, 64, share_embeddings_and_output_weights=False)
            chunks = [c.cuda() for c in chunks] if cuda else chunks
            if state is None:
                state = [c.state_dict() for c in chunks]
            for c, saved in zip(chunks, state):
                c.load_state_dict(saved)
            model = wrap_in_ddp(chunks, config, default_ddp_config())
            config.finalize_model_grads_func = finalize_model_grads
            self.models[per_token] = model

    def router_grads(self, mode: str, *, per_token: bool, patched: bool) -> dict:
        """The router weights' gradient of one aux-only step (advantages 0: the PG term is 0)."""
        from dataclasses import replace

        import torch

        from megatron_pg_agg.core.losses import PGLossConfig
        from megatron_pg_agg.data.planner import PlanConfig, plan_step
        from megatron_pg_agg.megatron.moe import clear_moe_aux_loss_scale
        from megatron_pg_agg.megatron.step import StepGroups, run_pg_step
        from megatron_pg_agg.parity import VOCAB, parity_rollouts
        from megatron_pg_agg.patches import _machinery, moe_aux_loss

        if patched != _machinery.is_applied(moe_aux_loss.PATCH):
            (_machinery.apply if patched else _machinery.revert)(moe_aux_loss.PATCH)
        cfg = PGLossConfig(mode=mode, divisor=16.0 if mode == "constant" else None, kl_coef=0.0, entropy_coef=0.0)
        rollouts = [replace(r, advantages=[0.0] * len(r.advantages)) for r in parity_rollouts(with_ref=False)]
        plan = plan_step(rollouts, cfg, PlanConfig(dp_size=1, num_microbatches=3, vocab_size=VOCAB))
        model = self.models[per_token]
        clear_moe_aux_loss_scale()
        run_pg_step(model, plan, cfg, StepGroups.from_parallel_state(), dp_rank=0, experts=per_token and patched,
                    device=torch.device("cuda") if self.cuda else None)
        clear_moe_aux_loss_scale()
        return {"grads": {n: p.main_grad.detach().double().cpu() for c in model for n, p in c.module.named_parameters()
                          if n.endswith("router.weight")},
                "weight": plan.totals.pg_weight, "tokens": sum(mb.num_tokens for mb in plan.for_rank(0))}


def moe_strength() -> dict:
    """``factor`` (<g, g_default> / <g_default, g_default> over the routers) and the largest relative
    difference to Megatron's default averaging, every mode, patched and unpatched."""
    import torch
    import torch.distributed as dist

    from megatron_pg_agg.megatron.layout import ParallelSizes
    from megatron_pg_agg.megatron.parallel import init_distributed, init_parallel, shutdown_distributed
    from megatron_pg_agg.patches import apply_megatron_patches

    cuda = torch.cuda.is_available()
    apply_megatron_patches(cpu_gloo=not cuda, moe_aux_loss=True)
    fresh_rendezvous()
    init_distributed()
    init_parallel(ParallelSizes())
    twins = MoeTwins(cuda)
    default = twins.router_grads("token_mean", per_token=False, patched=False)
    ref = default["grads"]

    def compare(got: dict) -> dict:
        num = sum(float((got[k] * ref[k]).sum()) for k in ref)
        den = sum(float((ref[k] ** 2).sum()) for k in ref)
        err = max(float((got[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ref)
        return {"factor": num / den, "max_rel_err": err}

    rows = {"default_router_grad_max": max(float(g.abs().max()) for g in ref.values()), "modes": {}}
    for mode in MODES:
        patched = twins.router_grads(mode, per_token=True, patched=True)
        unpatched = twins.router_grads(mode, per_token=True, patched=False)
        rows["modes"][mode] = {**compare(patched["grads"]), "weight": patched["weight"], "tokens": patched["tokens"],
                               "unpatched": compare(unpatched["grads"]),
                               "unpatched_predicted_factor": patched["tokens"] / patched["weight"]}
    twins.router_grads("token_mean", per_token=True, patched=True)  # leave the patch applied
    dist.barrier()
    shutdown_distributed()
    return rows


WORKERS = {"a": check_a, "b": check_b, "c_rl": check_c_rl, "d": check_d}


def worker_main(name: str, spec_path: str, out_path: str) -> int:
    from megatron_pg_agg.training.logs import setup_logging
    from megatron_pg_agg.training.worker_process import die_with_launcher, keep_freed_memory, quiet_startup_noise

    keep_freed_memory()
    die_with_launcher()
    setup_logging("[train]")
    quiet_startup_noise(outside_info=True)
    with open(spec_path) as f:
        spec = json.load(f)
    out = Out(out_path)
    out.part("worker", lambda: WORKERS[name](spec, out) or "finished")
    return 1 if out.data.get("errors") else 0


# ----------------------------------------------------------------------------- the driver


def torchrun(*args) -> list:
    from megatron_pg_agg.megatron.torchrun import torchrun_command  # noqa: PLC0415 (the driver imports no torch before)

    return [*torchrun_command(), "--standalone", "--nproc_per_node", "1", *map(str, args)]


def pretrain_command(profile: str, megatron_lm: str, rollouts: str, metrics: str) -> list:
    size = SIZES[profile]["c_pretrain"]
    return torchrun(
        ROOT / "launch" / "pretrain_actor.py", "--megatron-lm", megatron_lm, "--pg-loss-aggregation", "prompt_mean",
        "--calculate-per-token-loss", *size["model"], "--micro-batch-size", "1",
        "--global-batch-size", size["global_batch"], "--train-iters", "20", "--lr", "1e-4", "--log-interval", "5",
        "--tokenizer-type", "NullTokenizer", "--hidden-dropout", "0", "--attention-dropout", "0",
        *MLM_BACKEND[profile], *MLM_LOCAL, *PROD, "--pg-rollouts", rollouts, "--pg-metrics-file", metrics)


def pretrain_result(metrics: str, log: str) -> dict:
    """The pretrain run's records (one per iteration) and Megatron-LM's own iteration times."""
    records = [json.loads(line) for line in Path(metrics).read_text().splitlines()] if os.path.exists(metrics) else []
    with open(log, errors="replace") as f:
        ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", f.read())]
    pick = ("iteration", "objective", "weight", "grad_norm", "clip_fraction", "entropy")
    return {"iterations": len(records), "first": {k: records[0].get(k) for k in pick} if records else None,
            "last": {k: records[-1].get(k) for k in pick} if records else None,
            "objective": [r.get("objective") for r in records], "grad_norm": [r.get("grad_norm") for r in records],
            "megatron_iteration_ms": ms}


def _descendants(pid: int) -> list:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(c) for c in f.read().split()]
        except OSError:
            kids = []
        out.extend(kids)
        todo.extend(kids)
    return out


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the launch and every process it started (torchrun's workers run in sessions of their
    own), then SIGKILL what is left after 15 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in [proc.pid, *_descendants(proc.pid)]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=15)
            if not _descendants(proc.pid):
                return
        except subprocess.TimeoutExpired:
            pass


def launch(cmd: list, limit_s: float, log_path: str):
    """Run ``cmd`` (from the repository root) with its output in ``log_path``: exit status, or
    None when it ran past ``limit_s`` (then it is stopped)."""
    env = {**os.environ, "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"), "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            stop(proc)
            return None


def environment(megatron_lm) -> dict:
    import torch

    import megatron_pg_agg
    from megatron_pg_agg.versions import installed_megatron_core_version

    env = {"torch": torch.__version__, "megatron_core": installed_megatron_core_version(),
           "python": platform.python_version(), "cuda": torch.cuda.is_available(),
           "transformer_engine": _has("transformer_engine"), "apex": _has("apex"),
           "package": package_check(Path(megatron_pg_agg.__file__).parent), "megatron_lm": megatron_lm,
           "commit": _git("rev-parse", "HEAD"), "started": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    if env["cuda"]:
        props = torch.cuda.get_device_properties(0)
        env.update(device=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
                   gpu_memory_gib=props.total_memory / 2**30, capability=list(torch.cuda.get_device_capability(0)))
    else:
        env["device"] = f"cpu ({os.cpu_count()} cores)"
    return env


def _has(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _git(*args) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def package_check(installed: Path) -> dict:
    """Where megatron_pg_agg was imported from, and the tree's files that differ from it (a wheel
    built before the last change of the code is stale)."""
    import importlib.util

    patches = Path(importlib.util.find_spec("megatron_pg_agg.patches").origin).parent
    pairs = [(ROOT / "megatron_pg_agg", installed), (ROOT / "patches", patches)]
    differ = [str(src.relative_to(ROOT)) for tree, inst in pairs for src in sorted(tree.rglob("*.py"))
              if not (inst / src.relative_to(tree)).is_file()
              or (inst / src.relative_to(tree)).read_bytes() != src.read_bytes()]
    return {"path": str(installed), "differs_from_tree": differ}


def suggested_name(env: dict) -> str:
    card = re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-")
    return f"{card}-{env['started'][:10]}.json"


def plan_checks(args, profile: str, tmp: str) -> dict:
    """``{check: (command, out JSON or None, reason to skip or None)}``."""
    from megatron_pg_agg.data.rollout_files import write_rollouts
    from megatron_pg_agg.versions import in_range, installed_megatron_core_version

    checks = {}
    for name in ("a", "b", "d"):
        spec = {**SIZES[profile][name], "dir": tmp}
        checks[name] = worker_command(name, spec, tmp)
    rollouts = os.path.join(tmp, "c-rollouts.jsonl")
    write_rollouts(rollouts, {0: make_rollouts(**SIZES[profile]["a"]["rollouts"])})
    no_checkout = "no Megatron-LM checkout: pass --megatron-lm PATH" if not args.megatron_lm else None
    checks["c_pretrain"] = (pretrain_command(profile, args.megatron_lm, rollouts, os.path.join(tmp, "c-pretrain.jsonl")),
                            None, no_checkout)
    core = installed_megatron_core_version()
    rl = {"argv": SIZES[profile]["c_rl"], "dir": tmp, "megatron_lm": args.megatron_lm, "gpu": profile == "gpu"}
    cmd, out, _ = worker_command("c_rl", rl, tmp)
    old = None if in_range(core, ">=0.19.0,<0.20") else (
        f"megatron-core {core}: the RL entry targets Megatron-LM's RL loop of core_v0.19.x (megatron-core >=0.19,<0.20)")
    checks["c_rl"] = (cmd, out, no_checkout or old)
    return {name: checks[name] for name in CHECKS if name in checks}


def worker_command(name: str, spec: dict, tmp: str) -> tuple:
    spec_path, out = os.path.join(tmp, f"{name}.spec.json"), os.path.join(tmp, f"{name}.out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    return torchrun(Path(__file__).resolve(), "--worker", name, "--spec", spec_path, "--out", out), out, None


def run_check(name: str, cmd: list, out: str, skip, limit_s: float, tmp: str) -> dict:
    if skip:
        return {"status": "skipped", "reason": skip}
    log = os.path.join(tmp, f"{name}.log")
    t0 = time.monotonic()
    rc = launch(cmd, limit_s, log)
    entry = {"status": "done" if rc == 0 else ("timeout" if rc is None else "failed"), "exit": rc,
             "seconds": round(time.monotonic() - t0, 1), "limit_s": limit_s}
    if out and os.path.exists(out):
        with open(out) as f:
            entry["result"] = json.load(f)
    elif name == "c_pretrain":
        entry["result"] = pretrain_result(os.path.join(tmp, "c-pretrain.jsonl"), log)
    if rc != 0:
        with open(log, errors="replace") as f:
            entry["tail"] = f.read()[-6000:]
    return entry


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=False, help="write the report here")
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny sizes: the same code paths")
    parser.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM_PATH"), metavar="PATH",
                        help="a Megatron-LM checkout of the installed megatron-core's release (check c)")
    parser.add_argument("--only", nargs="+", choices=CHECKS, default=list(CHECKS), help="run these checks only")
    parser.add_argument("--keep", metavar="DIR", help="keep the logs and run files in DIR")
    parser.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.spec, args.out)
    if args.megatron_lm:
        args.megatron_lm = str(Path(args.megatron_lm).resolve())
    import torch

    profile = "dry" if args.dry_run else "gpu"
    if profile == "gpu" and not torch.cuda.is_available():
        print("[gpu_e2e] no CUDA device: run with --dry-run on CPU", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="gpu_e2e-") as scratch:
        tmp = args.keep or scratch
        os.makedirs(tmp, exist_ok=True)
        return drive(args, profile, tmp)


def drive(args, profile: str, tmp: str) -> int:
    t0 = time.monotonic()
    report = {"profile": "gpu" if profile == "gpu" else "dry run (CPU, gloo, tiny sizes)",
              **environment(args.megatron_lm), "limits_s": LIMITS_S[profile], "checks": {}}
    report["suggested_name"] = suggested_name(report)
    print(f"[gpu_e2e] {report['device']}, torch {report['torch']}, megatron-core {report['megatron_core']}, "
          f"package from {report['package']['path']}", file=sys.stderr, flush=True)
    for name, (cmd, out, skip) in plan_checks(args, profile, tmp).items():
        if name not in args.only:
            continue
        entry = run_check(name, cmd, out, skip, LIMITS_S[profile][name], tmp)
        report["checks"][name] = entry
        what = entry["status"] + (f" ({entry['seconds']:.0f} s)" if "seconds" in entry else f": {entry.get('reason')}")
        print(f"[gpu_e2e] {name}: {what}", file=sys.stderr, flush=True)
        write_report(report, args.json)
    report["failed"] = [n for n, e in report["checks"].items() if e["status"] in ("failed", "timeout")]
    report["total_s"] = round(time.monotonic() - t0, 1)
    write_report(report, args.json)
    print(f"[gpu_e2e] {len(report['checks'])} checks in {report['total_s']:.0f} s; failed: {report['failed'] or 'none'}",
          file=sys.stderr, flush=True)
    return 1 if report["failed"] else 0


def write_report(report: dict, path) -> None:
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1, default=float)
        os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())

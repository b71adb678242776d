"""The layout fuzzer: random cases against the float64 reference (``--fuzz N --seed S``).

A case is a pure function of its own seed (:func:`draw_case`): a parallel layout of world size 1
to 4 (DP, TP with or without sequence parallelism, PP with or without virtual stages, CP, EP),
MoE and MTP on or off, a microbatch count or token capacity, a ragged step (lengths 1..L,
all-masked responses and groups, filtered numerators, prompt groups that the planner spreads over
ranks and microbatches, sometimes a step with W = 0), and the loss settings (every mode with a
random divisor, every policy loss, KL estimator and coefficient, entropy coefficient, rollout
correction). The run's seed gives the case seeds; ``--fuzz-case SEED`` reruns one case alone.

Cases are checked on the host first (:func:`host_problem`): a composition megatron-core (or this
CPU machine) refuses is drawn again, never counted. Each accepted case then runs the real schedule
in a ``torchrun`` of its world size (:mod:`megatron_pg_agg.parity.fuzz_worker`); a case the
launch refuses at build time is drawn again too. Every case compares the objective, every
reported field, the grad norm and the gradients with the float64 reference.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

from megatron_pg_agg.core.losses import KL_ESTIMATORS, POLICY_LOSSES, ROLLOUT_CORRECTIONS, PGLossConfig
from megatron_pg_agg.core.modes import MODES
from megatron_pg_agg.data.rollouts import Rollout
from megatron_pg_agg.megatron.torchrun import torchrun_command

from .fixture import MOE_EXPERTS, NUM_LAYERS, VOCAB, ParityCase

__all__ = ["FuzzCase", "draw_case", "fuzz_rollouts", "host_problem", "main", "run_fuzz"]

MAX_WORLD = 4
HEADS = 4  # the tiny model's attention heads (TINY_SIZES): TP must divide them
RERUN = "python -m megatron_pg_agg.parity --fuzz-case {seed}"


@dataclass(frozen=True)
class FuzzCase:
    """One drawn case: a layout, a step and loss settings (JSON-able)."""

    seed: int
    """The case's own seed: everything below is drawn from it."""
    layout: dict
    """:class:`~megatron_pg_agg.parity.fixture.ParityCase` fields."""
    loss: dict
    """:class:`~megatron_pg_agg.core.losses.PGLossConfig` fields."""
    data: dict
    """The step's shape: groups, max length, masking probabilities, W = 0."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism with TP (refused on CPU: the local spec's norms)."""

    @property
    def parity_case(self) -> ParityCase:
        return ParityCase(**self.layout)

    @property
    def world(self) -> int:
        return self.parity_case.world

    def describe(self) -> str:
        c = self.parity_case
        parts = [f"DP={c.dp}"] + [f"{n}={v}" for n, v in (("TP", c.tp), ("PP", c.pp), ("CP", c.cp), ("EP", c.ep))
                                  if v > 1]
        if c.vpp:
            parts.append(f"VPP={c.vpp}")
        if self.sequence_parallel:
            parts.append("SP")
        if c.experts:
            parts.append(f"MoE({c.dispatcher})")
        if c.mtp:
            parts.append("MTP")
        if c.per_token_model:
            parts.append("per-token model")
        parts.append(f"cap={c.max_tokens}" if c.max_tokens else f"mb={c.num_microbatches}")
        loss = self.loss
        extra = [f"L={loss['divisor']:g}"] if loss.get("divisor") else []
        extra += [f"kl={loss['kl_coef']:g}({loss['kl_estimator']})"] if loss["kl_coef"] else []
        extra += [f"ent={loss['entropy_coef']:g}"] if loss["entropy_coef"] else []
        extra += [loss["rollout_correction"]] if loss.get("rollout_correction") else []
        zero = " W=0" if self.data["zero_step"] else ""
        return f"{' '.join(parts)} | {loss['mode']} {loss['policy_loss']} {' '.join(extra)}{zero}".strip()


def _case_seed(run_seed: int, index: int, attempt: int) -> int:
    return random.Random(f"{run_seed}/{index}/{attempt}").randrange(2 ** 31)


def draw_case(seed: int) -> FuzzCase:
    """The case of ``seed`` (deterministic)."""
    rng = random.Random(seed)
    world = rng.randint(1, MAX_WORLD)
    sizes = {"tp": 1, "pp": 1, "cp": 1}
    rest = world
    for name in rng.sample(list(sizes), k=3):  # factor the world: each axis takes a divisor of the rest
        divisors = [d for d in range(1, rest + 1) if rest % d == 0]
        sizes[name] = rng.choice(divisors) if rng.random() < 0.5 else 1
        rest //= sizes[name]
    dp = rest
    experts = MOE_EXPERTS if rng.random() < 0.25 else 0
    ep = rng.choice([d for d in (1, 2, 4) if dp % d == 0]) if experts else 1
    vpp = rng.choice((None, 2)) if sizes["pp"] > 1 else None
    layout = dict(
        name=f"fuzz {seed}", tp=sizes["tp"], pp=sizes["pp"], vpp=vpp, cp=sizes["cp"], dp=dp,
        num_microbatches=rng.randint(1, 5), per_token_model=sizes["cp"] > 1 or rng.random() < 0.1,
        experts=experts, ep=ep, dispatcher=rng.choice(("alltoall", "allgather")),
        mtp=rng.random() < 0.15, max_tokens=rng.choice((None, None, rng.randint(24, 96))))
    mode = rng.choice(MODES)
    policy_loss = rng.choice(POLICY_LOSSES)
    loss = dict(
        mode=mode, divisor=round(rng.uniform(1.0, 32.0), 3) if mode == "constant" else None,
        policy_loss=policy_loss, clip_eps_low=rng.choice((0.1, 0.2, 0.3)),
        clip_eps_high=rng.choice((0.2, 0.28, 0.4)),
        dual_clip=rng.choice((None, 3.0)) if policy_loss == "ppo" else None,
        kl_coef=rng.choice((0.0, 0.0, 0.05, 0.3)), kl_estimator=rng.choice(KL_ESTIMATORS),
        entropy_coef=rng.choice((0.0, 0.0, 0.01)),
        rollout_correction=rng.choice((None, None, None, *ROLLOUT_CORRECTIONS)),
        rollout_correction_max=rng.choice((1.5, 2.0)), rollout_correction_min=rng.choice((0.0, 0.5)))
    data = dict(
        rollout_seed=rng.randrange(2 ** 31), groups=rng.randint(1, 6), max_group=rng.randint(1, 4),
        max_len=rng.randint(1, 24), prompt_len=rng.randint(1, 6), mask_p=rng.choice((0.0, 0.15, 0.3)),
        empty_p=rng.choice((0.0, 0.15)), empty_group_p=rng.choice((0.0, 0.15)),
        filter_p=rng.choice((0.0, 0.2)), zero_step=rng.random() < 0.05)
    return FuzzCase(seed=seed, layout=layout, loss=loss, data=data,
                    sequence_parallel=sizes["tp"] > 1 and rng.random() < 0.3)


def fuzz_rollouts(case: FuzzCase) -> list:
    """The case's step (deterministic from its data seed): ragged groups in shuffled order,
    all-masked responses and groups, filtered numerator tokens, old/rollout/reference log-probs
    near the tiny model's range."""
    d = case.data
    rng = random.Random(d["rollout_seed"])
    rollouts = []
    for g in range(d["groups"]):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, d["prompt_len"]))]
        empty_group = d["zero_step"] or rng.random() < d["empty_group_p"]
        for _ in range(rng.randint(1, d["max_group"])):
            n = rng.randint(1, d["max_len"])
            empty = empty_group or rng.random() < d["empty_p"]
            mask = [0 if empty or rng.random() < d["mask_p"] else 1 for _ in range(n)]
            adv = rng.uniform(-1.5, 1.5)
            old = [-rng.uniform(3.0, 5.0) for _ in range(n)]
            rollouts.append(Rollout(
                prompt_ids=prompt, response_ids=[rng.randrange(VOCAB) for _ in range(n)], loss_mask=mask,
                advantages=[adv + rng.uniform(-0.1, 0.1) for _ in range(n)], old_logprobs=old,
                ref_logprobs=[-rng.uniform(3.0, 5.0) for _ in range(n)], group_id=f"g{g}",
                numerator_mask=[m if rng.random() >= d["filter_p"] else 0 for m in mask],
                rollout_logprobs=[o + rng.uniform(-0.8, 0.8) for o in old]))
    if not d["zero_step"] and not any(m for r in rollouts for m in r.loss_mask):
        rollouts[0].loss_mask[0] = 1  # W = 0 only where drawn as such (it is checked, but cheaply)
    rng.shuffle(rollouts)
    return rollouts


def host_problem(case: FuzzCase, *, mtp_supported: bool = True, cuda: bool = False) -> Optional[str]:
    """Why megatron-core, the planner or this machine refuses the case (None: it runs)."""
    c = case.parity_case
    if HEADS % c.tp:
        return f"TP={c.tp} does not divide the {HEADS} attention heads (megatron-core asserts it)"
    if NUM_LAYERS % (c.pp * (c.vpp or 1)):
        return f"PP={c.pp} x VPP={c.vpp} does not divide the {NUM_LAYERS} layers"
    if case.sequence_parallel and not cuda:
        return "sequence parallelism needs Transformer Engine's norms (the local spec refuses it on CPU)"
    if c.cp > 1 and not (c.per_token_model or cuda):
        return "CP attention needs Transformer Engine (CPU: the per-token model only)"
    if c.per_token_model and (c.tp > 1 or c.pp > 1 or c.experts or c.mtp):
        return "the per-token model runs with TP = PP = 1, no experts, no MTP"
    if c.mtp and not mtp_supported:
        return "MTP needs the mtp_loss patch's megatron-core releases"
    if c.experts and c.tp > 1:
        return "megatron-core's MoE layer refuses TP without sequence parallelism (which needs TE on CPU)"
    if c.mtp and c.experts:
        return "MTP with MoE is not in the parity model set"
    if c.experts and c.dp % c.ep:
        return f"EP={c.ep} does not divide DP={c.dp}"
    if c.vpp and c.num_microbatches % c.pp and c.max_tokens is None:
        return f"the interleaved schedule needs the microbatches ({c.num_microbatches}) divisible by PP={c.pp}"
    if c.vpp and c.max_tokens is not None:
        return "the interleaved schedule runs with a fixed microbatch count here (divisible by PP)"
    try:
        PGLossConfig(**case.loss)
    except (TypeError, ValueError) as exc:
        return f"loss settings: {exc}"
    from megatron_pg_agg.data.planner import plan_step  # noqa: PLC0415
    from megatron_pg_agg.data.rollouts import PlanError  # noqa: PLC0415

    from .workers import plan_config  # noqa: PLC0415

    try:
        plan_step(fuzz_rollouts(case), PGLossConfig(**case.loss), plan_config(c))
    except PlanError as exc:
        return f"planner: {exc}"
    return None


@dataclass
class FuzzRun:
    """What a fuzz run drew and how each case ended."""

    seed: int
    rows: list = field(default_factory=list)
    refused: list = field(default_factory=list)


CASES_PER_LAUNCH = 24
"""At most this many cases share one torchrun. Why: a process keeps every case's gloo groups
alive, and a 1-rank launch of 207 cases (a 500-case run) died with SIGSEGV after 16 minutes."""


def _batches(cases: list) -> list:
    """The launches of ``cases``: by world size, at most :data:`CASES_PER_LAUNCH` each, in order."""
    by_world = {}
    for case in cases:
        by_world.setdefault(case.world, []).append(case)
    return [(world, group[i:i + CASES_PER_LAUNCH]) for world, group in sorted(by_world.items())
            for i in range(0, len(group), CASES_PER_LAUNCH)]


def _read_rows(path: str) -> list:
    """The rows rank 0 wrote so far, one JSON object per line (a torn last line is dropped)."""
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break
    return rows


def _run_launch(world: int, group: list, timeout_s: float, log) -> tuple:
    """One torchrun of ``group``: (the rows it wrote, why it died or None, its output)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = os.path.join(tmp, "cases.json"), os.path.join(tmp, "rows.jsonl")
        with open(spec, "w") as f:
            json.dump([asdict(c) for c in group], f)
        cmd = [*torchrun_command(), "--standalone", "--nproc_per_node", str(world),
               "-m", "megatron_pg_agg.parity.fuzz_worker", spec, out]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        log(f"[fuzz] launching {world} rank(s): {len(group)} case(s)")
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout_s)
            died = proc.returncode != 0 and f"exit code {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            died = f"no end after {timeout_s:.0f}s"
        rows = _read_rows(out)
        log(f"[fuzz] {world} rank(s): {len(rows)}/{len(group)} case(s) in {time.monotonic() - t0:.1f}s"
            + (f"; the launch died ({died})" if died else ""))
        return rows, (died or None), output


def _launch(cases: list, timeout_s: float, log):
    """Run ``cases``, yielding one row per case as each launch ends. A launch that dies keeps the
    rows its cases wrote; the case it died on becomes a failed row naming the cause (the launch's
    output tail, and the case's rerun command through its seed), and the cases after it run in
    a new launch: nothing drawn is lost or counted twice."""
    queue = _batches(cases)
    while queue:
        world, group = queue.pop(0)
        rows, died, output = _run_launch(world, group, timeout_s, log)
        yield from rows
        if len(rows) >= len(group):
            if died:  # every case wrote its row, then the launch failed on its way out
                log(f"[fuzz] warning: the launch of {world} rank(s) died after its last case ({died})")
            continue
        culprit = group[len(rows)]
        tail = "\n".join(output.strip().splitlines()[-15:])
        yield {"seed": culprit.seed, "case": culprit.describe(), "world": world, "passed": False,
               "error": f"the launch died on this case ({died or 'no row written'}); its last lines:\n{tail}"}
        if len(rows) + 1 < len(group):
            queue.insert(0, (world, group[len(rows) + 1:]))


def run_fuzz(n: int, seed: int, *, timeout_s: float = 1800.0, log=print, case_seeds=None) -> FuzzRun:
    """Draw and run ``n`` accepted cases from ``seed`` (or exactly ``case_seeds``)."""
    import torch  # noqa: PLC0415

    from megatron_pg_agg.patches import mtp_loss  # noqa: PLC0415
    from megatron_pg_agg.versions import in_range, installed_megatron_core_version  # noqa: PLC0415

    mtp_supported = in_range(installed_megatron_core_version(), mtp_loss.SUPPORTED)
    cuda = torch.cuda.is_available()
    run = FuzzRun(seed)
    slots = [(i, 0) for i in range(n)] if case_seeds is None else None
    pending = [draw_case(s) for s in case_seeds] if case_seeds is not None else []
    while slots or pending:
        batch, owner = [], {}
        for index, attempt in (slots or []):
            while True:  # draw until the host accepts (a refused case never counts)
                case = draw_case(_case_seed(seed, index, attempt))
                problem = host_problem(case, mtp_supported=mtp_supported, cuda=cuda)
                if problem is None:
                    break
                run.refused.append({"seed": case.seed, "case": case.describe(), "why": problem})
                attempt += 1
            batch.append(case)
            owner[case.seed] = (index, attempt)
        for case in pending:
            problem = host_problem(case, mtp_supported=mtp_supported, cuda=cuda)
            if problem is not None:
                run.refused.append({"seed": case.seed, "case": case.describe(), "why": problem})
            else:
                batch.append(case)
        slots, pending = [], []
        for row in _launch(batch, timeout_s, log):
            if row.get("refused"):  # megatron-core refused it at build time: draw that slot again
                run.refused.append(row)
                if row["seed"] in owner:
                    index, attempt = owner[row["seed"]]
                    slots.append((index, attempt + 1))
                continue
            row["rerun"] = RERUN.format(seed=row["seed"])
            run.rows.append(row)
            log(_format(row))
    return run


def _format(row: dict) -> str:
    if "error" in row:
        return f"FAIL {row['seed']:>10} {row['case']}: {row['error']}\n     rerun: {row['rerun']}"
    status = "ok  " if row["passed"] else "FAIL"
    line = (f"{status} {row['seed']:>10} {row['case']}: J {row['objective']:+.6f} ref {row['reference']:+.6f} "
            f"rel {row['objective_rel_err']:.1e}, fields {row['fields_max_err']:.1e}, grad norm "
            f"{row['grad_norm_rel_err']:.1e}, grads {row['grad_max_rel_err']:.1e}")
    return line if row["passed"] else f"{line}\n     rerun: {row['rerun']}"


def main(args) -> int:
    """``--fuzz N --seed S [--json FILE]`` or ``--fuzz-case SEED``; the last line is
    ``fuzz: K/N cases passed (seed S)``."""
    if args.fuzz_case is not None:
        n, seed, seeds = 1, args.fuzz_case, [args.fuzz_case]
    else:
        n, seed, seeds = args.fuzz, args.seed, None
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    print(f"[fuzz] seed {seed}: {n} case(s)", flush=True)
    run = run_fuzz(n, seed, timeout_s=args.timeout, case_seeds=seeds,
                   log=lambda *a: print(*a, flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seed": seed, "rows": run.rows, "refused": run.refused}, f, indent=1)
    failed = [r for r in run.rows if not r["passed"]]
    print(f"[fuzz] {len(run.refused)} drawn case(s) refused and drawn again "
          f"({len({r['why'].split(':')[0] for r in run.refused})} reasons)")
    for row in failed:
        print(f"[fuzz] failed: {row['case']}: {row['rerun']}")
    passed = len(run.rows) - len(failed)
    print(f"fuzz: {passed}/{len(run.rows)} cases passed (seed {seed})")
    return 0 if not failed and len(run.rows) == n else 1

"""AReaL 1.0.4's own Megatron actor with the plug-in, every case against the float64 reference (torchrun).

    torchrun --nproc-per-node {1,2} -m tests.distributed.workers.areal_checks DIR OUT.json [CASE_NAMES]

DIR: the tiny Qwen3 and tokenizer of ``areal_worker --make-model``. Every rank builds the plug-in's
actor (:func:`megatron_pg_agg.integrations.areal_plugin.actor_class`, AReaL's ``MegatronPPOActor``
subclass) through AReaL's own initialisation (``areal_worker``: its config, ``create_process_group``,
``initialize``, mbridge, the distributed optimizer), float32, once; the cases then change only what
AReaL reads per call (``mb_spec``, ``ppo_n_minibatches``, the loss options, ``m2_threshold``, the
objective). Each case runs AReaL's ``compute_advantages`` (its group normalisation) and
``ppo_update`` on the same 4 prompt groups x 3 ragged responses (areal_worker.make_groups; DP rank r
holds groups [r*4/dp, (r+1)*4/dp)), with the optimizer step replaced by a capture of the step's full
gradient, so every case starts from the same weights.

Per optimizer step the worker records:

* ``objective``: what the engine back-propagated, ``sum_i L_i w_i / W`` over every micro-batch of
  every DP rank (AReaL's ``_compute_logprobs_and_loss`` output divided by its loss multiplier);
* for a case with a reference: ``reference``, the step's J from ``megatron_pg_agg.parity.
  step_objective`` (the README's formulas, float64, no package loss or aggregation code) on
  transformers' float64 model of DIR, with the rows' advantages and old log-probs as AReaL computed
  them; ``grad_error``: |g - g_ref| / |g_ref| over every parameter, the engine's gradient exported
  to HF names by mbridge's own export (a linear map: a gradient maps as its weight);
* ``grad``: the flat gradient (for the split-independence checks of the cases without reference).

Rank 0 writes ``{"world", "cases": {name: {"case", "steps": [...], "seconds"}}, "times"}``.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from tests.distributed.workers.areal_worker import GROUP_SIZE, GROUPS, actor_config, full_gradient, make_groups

T0 = time.monotonic()
SPLITS = {"1mb": dict(n_mbs=1), "3mb": dict(n_mbs=3), "cap30": dict(n_mbs=1, max_tokens_per_mb=30)}
"""Micro-batch splits: one micro-batch, three, and a token cap (AReaL packs whole sequences)."""
DIVISOR = 12.0
M2 = 0.04
DUAL_CLIP = 1.1
"""AReaL's c_clip (> 1): low enough that the cap binds on some tokens of this batch."""


def _case(name, mode, split, steps=1, loss="ppo", m2=None, kind="plugin", baseline=None, centred=False):
    return dict(name=name, mode=mode, split=split, ppo_n_minibatches=steps, loss=loss, m2=m2, kind=kind,
                baseline=baseline, centred=centred)


def all_cases() -> list:
    cases = []
    for mode in ("token_mean", "seq_mean", "prompt_mean", "constant"):
        for split in SPLITS:
            for steps in (1, 2):
                cases.append(_case(f"{mode}-{split}-steps{steps}", mode, split, steps))
    for split in SPLITS:  # controls: AReaL's own token mean, and the loss alone swapped
        cases.append(_case(f"stock-{split}", "token_mean", split, kind="stock"))
        cases.append(_case(f"naive-seq-{split}", "seq_mean", split, kind="naive"))
    for loss in ("dual_clip", "gspo"):  # AReaL's other losses the reference writes out
        for split in ("1mb", "3mb"):
            # the dual clip caps negative advantages only: AReaL's group centring makes some
            cases.append(_case(f"{loss}-seq_mean-{split}", "seq_mean", split, loss=loss, centred=loss == "dual_clip"))
    for loss in ("decoupled", "sapo"):  # no reference formula here: split independence
        for split in SPLITS:
            cases.append(_case(f"{loss}-prompt_mean-{split}", "prompt_mean", split, loss=loss))
    for mode in ("token_mean", "prompt_mean"):  # M2PO: chosen once per step
        for split in SPLITS:
            cases.append(_case(f"m2po-{mode}-{split}", mode, split, loss="decoupled", m2=M2))
    cases.append(_case("sapo-stock-1mb", "token_mean", "1mb", loss="sapo", kind="stock"))
    # GRPO's per-response group baseline, under token_mean (DAPO's aggregation): under seq_mean a
    # centred baseline makes J vanish at ratio 1 (each group's advantages sum to 0), so J (~0.02) is a
    # cancellation of O(1) terms whose float32 noise sits at the 1e-6 bound; token_mean weighs each
    # response by its length and keeps J of order 0.1
    for baseline in ("response_mean", "response_mean_std"):
        cases.append(_case(f"baseline-{baseline}", "token_mean", "3mb", baseline=baseline))
    for split in SPLITS:  # control: AReaL's own M2PO
        cases.append(_case(f"m2po-stock-{split}", "token_mean", split, loss="decoupled", m2=M2, kind="stock"))
    return cases


def configure(actor, case: dict) -> None:
    """Set what AReaL reads per call: the engine's micro-batch spec, the actor's loss options and
    advantage normalisation. GRPO's std scaling without AReaL's centring by default: every
    advantage has its reward's sign, so J is of order 1 and float32's rounding of AReaL's own sums
    stays below the 1e-6 objective check (a centred batch has J near 0 from terms of order 1)."""
    from areal.api.cli_args import MicroBatchSpec, NormConfig
    from areal.utils.data import Normalization

    from megatron_pg_agg.integrations.areal_loss import ResponseGroupBaseline
    from megatron_pg_agg.integrations.areal_plugin import ArealObjective

    cfg = actor.actor.config  # the engine's config too: one PPOActorConfig
    actor.actor.adv_norm = Normalization(NormConfig(mean_level="group" if case["centred"] else None,
                                                    std_level="group", group_size=GROUP_SIZE))
    cfg.mb_spec = MicroBatchSpec(**SPLITS[case["split"]])
    cfg.ppo_n_minibatches = case["ppo_n_minibatches"]
    cfg.c_clip = DUAL_CLIP if case["loss"] == "dual_clip" else None
    cfg.importance_sampling_level = "sequence" if case["loss"] == "gspo" else "token"
    cfg.use_sapo_loss = case["loss"] == "sapo"
    decoupled = case["loss"] == "decoupled"
    cfg.use_decoupled_loss = decoupled
    cfg.recompute_logprob = decoupled
    actor.actor.m2_threshold = case["m2"]
    actor.pg_agg_objective = ArealObjective(case["mode"], DIVISOR if case["mode"] == "constant" else None,
                                            case["baseline"])
    actor.pg_agg_baseline = (None if case["baseline"] is None else
                             ResponseGroupBaseline(std=case["baseline"] == "response_mean_std"))


def naive_loss(loss_fn):
    """The loss alone swapped (the control): each micro-batch's mean over its sequences of their
    token means, under AReaL's token weight, through AReaL's own loss (advantages scaled)."""

    def loss(logprobs, entropy, data, **kwargs):
        mask = data["loss_mask"].bool()
        cu = data["cu_seqlens"].long()
        lengths = cu[1:] - cu[:-1]
        seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths, output_size=mask.numel())
        counts = torch.zeros(len(lengths)).index_add_(0, seq, mask.float())
        active = (counts > 0).sum()
        k = mask.sum() / (counts[seq].clamp(min=1) * active)
        return loss_fn(logprobs, entropy, {**data, "advantages": data["advantages"] * k}, **kwargs)

    return loss


def main(argv: list) -> None:
    path, out_path = argv[0], argv[1]
    wanted = set(argv[2].split(",")) if len(argv) > 2 else None
    torch.set_num_threads(1)
    os.environ["MEGATRON_PG_AGG_AREAL"] = "token_mean"  # the actor's first objective; each case sets its own
    from megatron_pg_agg.patches.cpu.areal_cpu import apply_areal_cpu_patches

    apply_areal_cpu_patches()
    import torch.distributed as dist
    from areal.api.alloc_mode import ModelAllocation
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.megatron_engine import MegatronPPOActor
    from areal.utils.data import concat_batch
    from megatron.core import parallel_state as mpu

    from megatron_pg_agg.integrations.areal_loss import GROUP, tag_groups, whole_group_minibatches
    from megatron_pg_agg.integrations.areal_plugin import actor_class

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    params = dict(n_mbs=1, max_tokens_per_mb=None, ppo_n_minibatches=1, distributed_optimizer=True)
    config = actor_config(path, world, params)
    actor = actor_class()(config=config)
    actor.create_process_group(parallel_strategy=ModelAllocation.from_str(config.backend, name="actor").parallel)
    actor.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=GROUPS * GROUP_SIZE,
                                        train_batch_size=GROUPS * GROUP_SIZE))
    t_ready = time.monotonic() - T0
    dp_group = mpu.get_data_parallel_group()

    # the engine's objective and gradient of each optimizer step
    captured, objective = [], [torch.zeros((), dtype=torch.float64)]
    compute = actor._compute_logprobs_and_loss

    def compute_and_record(output, inputs, loss_fn, loss_weight_fn, total_loss_weight, loss_multiplier=1.0):
        out = compute(output, inputs, loss_fn, loss_weight_fn, total_loss_weight, loss_multiplier=loss_multiplier)
        objective[0] = objective[0] + out.detach().double() / loss_multiplier
        return out

    def capture():
        names, numels, flat = full_gradient(actor)
        total = objective[0].clone()
        dist.all_reduce(total, group=dp_group)
        captured.append(dict(grad=flat, objective=float(total)))
        objective[0] = torch.zeros((), dtype=torch.float64)
        return dict(update_successful=1.0, grad_norm=float(flat.norm()), lr=actor.optimizer.param_groups[0]["lr"])

    actor._compute_logprobs_and_loss = compute_and_record
    actor.optimizer_step = capture
    names, numels = full_gradient(actor)[:2]
    groups, made = make_groups(path)
    pick = range(rank * GROUPS // world, (rank + 1) * GROUPS // world)
    mine = [groups[i] for i in pick]
    prompt_lengths = [[p for p, _ in made[g]] for g in pick]
    reference = Reference(path, actor, names, numels) if rank == 0 else None
    results = {}
    for case in all_cases():
        if wanted is not None and case["name"] not in wanted:
            continue
        t1 = time.monotonic()
        configure(actor, case)
        data = [dict(d) for d in mine]
        if case["loss"] == "decoupled":  # AReaL's trainer: the proximal log-probs recomputed first
            for d, logp in zip(data, actor.compute_logp(data)):
                d["prox_logp"] = logp
        data = actor.compute_advantages(data)
        captured.clear()
        if case["kind"] == "plugin":
            actor.ppo_update(data)
        elif case["kind"] == "stock":  # the plug-in off: AReaL's own update (no group marks)
            MegatronPPOActor.ppo_update(actor, data)
        else:  # naive: AReaL's own update and weight, the loss alone swapped
            train_batch = actor.train_batch
            actor.train_batch = lambda mb, loss_fn, loss_weight_fn: MegatronPPOActor.train_batch(
                actor, mb, naive_loss(loss_fn), loss_weight_fn)
            try:
                MegatronPPOActor.ppo_update(actor, data)
            finally:
                actor.train_batch = train_batch
        actor.export_stats()  # as AReaL's trainer does after each update (its tracker then starts afresh)
        # which groups each optimizer step held (the plug-in's whole-group split; stock: one step)
        marked, _ = concat_batch(tag_groups(data))
        local = (whole_group_minibatches(marked, case["ppo_n_minibatches"]) if case["kind"] == "plugin"
                 else [list(range(marked["attention_mask"].shape[0]))])
        step_groups = [sorted({pick[g] for g in marked[GROUP][rows, 0].tolist()}) for rows in local]
        rows = [[_row(d, i, prompt) for i, prompt in enumerate(lengths)] for d, lengths in zip(data, prompt_lengths)]
        gathered = [None] * world
        dist.all_gather_object(gathered, (list(pick), rows, step_groups))
        if rank == 0:
            by_group = {g: r for picks, group_rows, _ in gathered for g, r in zip(picks, group_rows)}
            steps = []
            for k, flat in enumerate(captured):
                members = sorted(g for _, _, sg in gathered for g in sg[k])
                row = dict(objective=flat["objective"], groups=members, grad_norm=float(flat["grad"].norm()))
                if reference.covers(case):
                    ref, ref_grad = reference.step(case, [(g, r) for g in members for r in by_group[g]])
                    row.update(reference=ref, grad_error=reference.grad_error(flat["grad"], ref_grad))
                else:
                    row["grad"] = flat["grad"].tolist()
                steps.append(row)
            response_means = [[sum(r["advantages"]) / max(len(r["advantages"]), 1) for r in by_group[g]]
                              for g in sorted(by_group)]
            results[case["name"]] = dict(case=case, steps=steps, seconds=time.monotonic() - t1,
                                         response_means=response_means)
            print(f"areal_checks: {case['name']}: " + "; ".join(
                f"J {s['objective']:.6g}" + (f" ref {s['reference']:.6g} grad_err {s['grad_error']:.1e}"
                                              if "reference" in s else "") for s in steps), flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(dict(world=world, cases=results, times=dict(ready=t_ready, total=time.monotonic() - T0)), f)
    dist.barrier()
    actor.destroy()


def _row(d: dict, i: int, prompt: int) -> dict:
    """Response ``i`` of AReaL's group dict after compute_advantages, in response positions:
    AReaL's rolled fields hold at position t the values of token t+1, so response token j is
    position ``prompt + j - 1``."""
    attn = d["attention_mask"][i].bool()
    ids = d["input_ids"][i][attn].tolist()
    mask = d["loss_mask"][i][attn].float()
    n = len(ids) - prompt
    at = slice(prompt - 1, prompt - 1 + n)
    return dict(prompt_ids=ids[:prompt], response_ids=ids[prompt:], loss_mask=mask[at].tolist(),
                advantages=d["advantages"][i][at].double().tolist(),
                old_logprobs=d["logprobs"][i][at].double().tolist())


class Reference:
    """transformers' float64 model of DIR, ``parity.step_objective`` and autograd; the engine's
    gradient exported to HF names by the actor's own mbridge."""

    def __init__(self, path: str, actor, names: list, numels: list):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
        self.actor, self.names, self.numels = actor, names, numels

    @staticmethod
    def covers(case: dict) -> bool:
        return case["loss"] in ("ppo", "dual_clip", "gspo") and case["m2"] is None

    def step(self, case: dict, members: list) -> tuple:
        from types import SimpleNamespace

        from megatron_pg_agg.core.losses import PGLossConfig
        from megatron_pg_agg.parity import step_objective

        cfg = PGLossConfig(mode="seq_mean" if case["kind"] == "naive" else case["mode"],
                           divisor=DIVISOR if case["mode"] == "constant" else None,
                           policy_loss="gspo" if case["loss"] == "gspo" else "ppo", clip_eps_low=0.2, clip_eps_high=0.2,
                           dual_clip=DUAL_CLIP if case["loss"] == "dual_clip" else None)
        rollouts = [SimpleNamespace(group_id=g, numerator_mask=None, **{**r, "loss_mask": [m > 0 for m in
                                                                                          r["loss_mask"]]})
                    for g, r in members]
        self.model.zero_grad(set_to_none=True)
        value, _ = step_objective(lambda ids: self.model(torch.tensor([ids])).logits[0], rollouts, cfg)
        value.backward()
        return float(value), {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}

    def grad_error(self, flat: torch.Tensor, ref_grad: dict) -> float:
        """|g - g_ref| / |g_ref| with g the engine's gradient in HF names: mbridge's export of
        the parameters holding the gradient (the weights are put back after)."""
        params = {}
        for chunk in self.actor.model:
            params.update(dict(chunk.module.named_parameters()))
        saved = {n: params[n].data.clone() for n in self.names}
        for name, part in zip(self.names, torch.split(flat, self.numels)):
            params[name].data.copy_(part.view_as(params[name]))
        try:
            exported = {n: t.detach().double().cpu() for n, t in self.actor.bridge.export_weights(self.actor.model)}
        finally:
            for n in self.names:
                params[n].data.copy_(saved[n])
        assert set(exported) == set(ref_grad), sorted(set(exported) ^ set(ref_grad))[:8]
        diff = sum(float((exported[n] - ref_grad[n]).pow(2).sum()) for n in ref_grad) ** 0.5
        norm = sum(float(g.pow(2).sum()) for g in ref_grad.values()) ** 0.5
        return diff / norm


if __name__ == "__main__":
    main(sys.argv[1:])

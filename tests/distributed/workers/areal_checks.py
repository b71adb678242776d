"""AReaL 1.0.4's own Megatron actor with the plug-in, every case against the float64 reference (torchrun).

    torchrun --nproc-per-node {1,2} -m tests.distributed.workers.areal_checks DIR OUT.json [CASE_NAMES]

DIR: the tiny Qwen3 and tokenizer of ``areal_worker --make-model``. Every rank builds the plug-in's
actor (:func:`megatron_pg_agg.integrations.areal.plugin.actor_class`, AReaL's ``MegatronPPOActor``
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

Distillation cases (``kd-*``): the same actor and batch with AReaL's ``teacher_logp`` (rolled like
its log-probs: position t holds the teacher's log-prob of token t+1), ``rl_loss_weight`` and
``distill_loss_weight`` in every group dict, as AReaL's trainer writes them; the reference adds the
KD term's token mean over the step's valid tokens (written here, float64) to ``step_objective``.

Critic cases (``critic-*``), after the actor's: the plug-in's critic (:func:`megatron_pg_agg.
integrations.areal.plugin.critic_class`, AReaL's ``MegatronPPOCritic`` subclass, ``is_critic=True``:
its value head random, no ``value_head.pt``) built the same way in the same processes; AReaL's
``compute_values`` gives V_old (moved by fixed noise so that the value clip binds on part of the
tokens), the actor's ``compute_advantages`` the returns, then the critic's ``ppo_update``. The
reference: transformers' float64 model's final hidden states (``model.model(...).last_hidden_state``)
times the critic's value-head weight read from the Megatron model (a float64 leaf), AReaL's clipped
squared error and the mode's formula written here (:class:`ValueReference`); the gradient of the
trunk exported to HF names by mbridge, and the head's, against autograd's.

Rank 0 writes ``{"world", "cases": {name: {"case", "steps": [...], "seconds"}}, "times", "critic"}``.
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
RL_WEIGHT, DISTILL_WEIGHT = 0.7, 0.3
"""AReaL's teacher.rl_loss_weight and teacher.distill_loss_weight for the joint KD cases (pure KD:
rl_loss_weight 0); larger than AReaL's default 0.005, so that a wrong KD term shows."""
VALUE_EPS = 0.05
"""critic.eps_clip: with V_old moved by noise of std 0.1 the clipped branch wins on part of the tokens."""
VALUE_NOISE = 0.1


def _case(name, mode, split, steps=1, loss="ppo", m2=None, kind="plugin", baseline=None, centred=False,
          teacher=None, value_mode=None):
    return dict(name=name, mode=mode, split=split, ppo_n_minibatches=steps, loss=loss, m2=m2, kind=kind,
                baseline=baseline, centred=centred, teacher=teacher, value_mode=value_mode)


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
    return cases + distillation_cases()


def distillation_cases() -> list:
    """AReaL's KD term: joint (prompt_mean PG beside it) and pure KD against the reference under
    every split (and 2 steps), joint with M2PO split-independent, AReaL's own joint KD (plug-in off,
    token mean, no M2PO: already exact) against the reference."""
    cases = []
    for split in SPLITS:
        cases.append(_case(f"kd-joint-prompt_mean-{split}", "prompt_mean", split, teacher="joint"))
        cases.append(_case(f"kd-pure-seq_mean-{split}", "seq_mean", split, teacher="pure"))
        cases.append(_case(f"kd-joint-m2po-prompt_mean-{split}", "prompt_mean", split, loss="decoupled", m2=M2,
                           teacher="joint"))
    cases.append(_case("kd-joint-prompt_mean-3mb-steps2", "prompt_mean", "3mb", steps=2, teacher="joint"))
    cases.append(_case("kd-stock-joint-3mb", "token_mean", "3mb", kind="stock", teacher="joint"))
    return cases


def critic_cases() -> list:
    """The critic: every mode x split x 1 and 2 steps; AReaL's own critic (plug-in off) under every
    split; a value_mode other than the policy's."""
    cases = []
    for mode in ("token_mean", "seq_mean", "prompt_mean", "constant"):
        for split in SPLITS:
            for steps in (1, 2):
                cases.append(_case(f"critic-{mode}-{split}-steps{steps}", mode, split, steps))
    for split in SPLITS:
        cases.append(_case(f"critic-stock-{split}", "token_mean", split, kind="stock"))
    cases.append(_case("critic-prompt_mean-value_mode-seq_mean", "prompt_mean", "3mb", value_mode="seq_mean"))
    return cases


def configure(actor, case: dict) -> None:
    """Set what AReaL reads per call: the engine's micro-batch spec, the actor's loss options and
    advantage normalisation. GRPO's std scaling without AReaL's centring by default: every
    advantage has its reward's sign, so J is of order 1 and float32's rounding of AReaL's own sums
    stays below the 1e-6 objective check (a centred batch has J near 0 from terms of order 1)."""
    from areal.api.cli_args import MicroBatchSpec, NormConfig
    from areal.utils.data import Normalization

    from megatron_pg_agg.integrations.areal.loss import ResponseGroupBaseline
    from megatron_pg_agg.integrations.areal.plugin import ArealSettings
    from megatron_pg_agg.integrations.objective import HostObjective

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
    actor.pg_agg_settings = ArealSettings(HostObjective(case["mode"], DIVISOR if case["mode"] == "constant" else None),
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


class Probe:
    """What an engine back-propagates and its gradient, per optimizer step: its
    ``_compute_logprobs_and_loss`` output divided by the loss multiplier, summed over the step's
    micro-batches and DP ranks; ``optimizer_step`` replaced by a capture of the full gradient (so
    every case starts from the same weights), or the capture then AReaL's own step (``stepping``)."""

    def __init__(self, engine, dp_group):
        import torch.distributed as dist

        self.engine, self.dp_group, self.dist = engine, dp_group, dist
        self.captured, self.objective, self.stepping = [], torch.zeros((), dtype=torch.float64), False
        self.compute, self.step = engine._compute_logprobs_and_loss, engine.optimizer_step
        engine._compute_logprobs_and_loss = self.compute_and_record
        engine.optimizer_step = self.capture

    def compute_and_record(self, output, inputs, loss_fn, loss_weight_fn, total_loss_weight, loss_multiplier=1.0):
        out = self.compute(output, inputs, loss_fn, loss_weight_fn, total_loss_weight, loss_multiplier=loss_multiplier)
        self.objective = self.objective + out.detach().double() / loss_multiplier
        return out

    def capture(self):
        names, numels, flat = full_gradient(self.engine)
        total = self.objective.clone()
        self.dist.all_reduce(total, group=self.dp_group)
        self.captured.append(dict(grad=flat, objective=float(total)))
        self.objective = torch.zeros((), dtype=torch.float64)
        if self.stepping:
            return self.step()
        return dict(update_successful=1.0, grad_norm=float(flat.norm()),
                    lr=self.engine.optimizer.param_groups[0]["lr"])


def main(argv: list) -> None:
    path, out_path = argv[0], argv[1]
    wanted = set(argv[2].split(",")) if len(argv) > 2 else None
    torch.set_num_threads(1)
    os.environ["MEGATRON_PG_AGG_AREAL"] = "token_mean"  # the first objective; each case sets its own
    from megatron_pg_agg.integrations.areal.cpu import apply_areal_cpu_patches

    apply_areal_cpu_patches()
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_pg_agg.integrations.areal.plugin import actor_class, critic_class
    from tests.distributed.workers.areal_worker import critic_config

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    params = dict(n_mbs=1, max_tokens_per_mb=None, ppo_n_minibatches=1, distributed_optimizer=True)
    actor = build(actor_class(), actor_config(path, world, params))
    t_ready = time.monotonic() - T0
    dp_group = mpu.get_data_parallel_group()
    probe = Probe(actor, dp_group)
    names, numels = full_gradient(actor)[:2]
    groups, made = make_groups(path)
    pick = list(range(rank * GROUPS // world, (rank + 1) * GROUPS // world))
    mine = [groups[i] for i in pick]
    prompt_lengths = [[p for p, _ in made[g]] for g in pick]
    reference = Reference(path, actor, names, numels) if rank == 0 else None
    run = Run(world, rank, pick, prompt_lengths)
    results = {}
    for case in all_cases():
        if wanted is None or case["name"] in wanted:
            run_actor_case(actor, probe, case, mine, run, reference, results)
    critic_info = {}
    todo = [case for case in critic_cases() if wanted is None or case["name"] in wanted]
    if todo:
        t1 = time.monotonic()
        critic = build(critic_class(), critic_config(path, world, VALUE_EPS))
        critic_info["ready"] = time.monotonic() - t1
        critic_probe = Probe(critic, dp_group)
        data = critic_batch(actor, critic, mine, pick)
        layout = full_gradient(critic)[:2]  # collective
        heads = ValueReference.head(critic, dp_group)  # collective
        values = ValueReference(reference, critic, heads, *layout) if rank == 0 else None
        for case in todo:
            run_critic_case(critic, critic_probe, case, data, run, values, results)
        critic_info.update(trains_head(critic, critic_probe, data, dp_group))
        critic.destroy()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(dict(world=world, cases=results, critic=critic_info,
                           times=dict(ready=t_ready, total=time.monotonic() - T0)), f)
    dist.barrier()
    actor.destroy()


def build(engine_class, config):
    """An AReaL Megatron engine as AReaL's trainer builds it in SPMD mode (areal_worker)."""
    from areal.api.alloc_mode import ModelAllocation
    from areal.api.io_struct import FinetuneSpec

    engine = engine_class(config=config)
    engine.create_process_group(parallel_strategy=ModelAllocation.from_str(config.backend, name="x").parallel)
    engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=GROUPS * GROUP_SIZE,
                                         train_batch_size=GROUPS * GROUP_SIZE))
    return engine


class Run:
    """This rank's share of the batch: the world, its groups (``pick``) and their prompt lengths."""

    def __init__(self, world, rank, pick, prompt_lengths):
        self.world, self.rank, self.pick, self.prompt_lengths = world, rank, pick, prompt_lengths

    def gather(self, data, rows_of, step_groups) -> tuple:
        """Every rank's rows (``rows_of(dict, i, prompt)`` per response, by global group) and the groups of
        each optimizer step, on rank 0."""
        import torch.distributed as dist

        rows = [[rows_of(d, i, prompt) for i, prompt in enumerate(lengths)]
                for d, lengths in zip(data, self.prompt_lengths)]
        gathered = [None] * self.world
        dist.all_gather_object(gathered, (self.pick, rows, step_groups))
        by_group = {g: r for picks, group_rows, _ in gathered for g, r in zip(picks, group_rows)}
        return by_group, gathered

    def step_groups(self, data, case, key) -> list:
        """The global groups of each optimizer step of this rank (the plug-in's whole-group split;
        stock: one step)."""
        from areal.utils.data import concat_batch

        from megatron_pg_agg.integrations.areal.loss import GROUP, tag_groups, whole_group_minibatches

        marked, _ = concat_batch(tag_groups(data))
        local = (whole_group_minibatches(marked, case["ppo_n_minibatches"], key) if case["kind"] == "plugin"
                 else [list(range(marked["attention_mask"].shape[0]))])
        return [sorted({self.pick[g] for g in marked[GROUP][rows, 0].tolist()}) for rows in local]


def run_actor_case(actor, probe, case, mine, run, reference, results) -> None:
    from areal.engine.megatron_engine import MegatronPPOActor

    t1 = time.monotonic()
    configure(actor, case)
    data = [dict(d) for d in mine]
    if case["loss"] == "decoupled":  # AReaL's trainer: the proximal log-probs recomputed first
        for d, logp in zip(data, actor.compute_logp(data)):
            d["prox_logp"] = logp
    if case["teacher"]:
        add_teacher(data, run.pick, case["teacher"])
    data = actor.compute_advantages(data)
    probe.captured.clear()
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
    by_group, gathered = run.gather(data, _row, run.step_groups(data, case, "actor.ppo_n_minibatches"))
    if run.rank != 0:
        return
    steps = []
    for k, flat in enumerate(probe.captured):
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
    _print(case, steps)


def _print(case, steps) -> None:
    print(f"areal_checks: {case['name']}: " + "; ".join(
        f"J {s['objective']:.6g}" + (f" ref {s['reference']:.6g} grad_err {s['grad_error']:.1e}"
                                      if "reference" in s else "") for s in steps), flush=True)


def add_teacher(data: list, pick: list, kind: str) -> None:
    """AReaL's trainer's distillation fields in each group dict: ``teacher_logp`` (per token, rolled
    like the log-probs AReaL compares it with: position t holds the teacher's log-prob of token t+1;
    here the student's own moved by fixed noise per group) and the two weights (floats)."""
    for d, g in zip(data, pick):
        noise = torch.randn(d["logprobs"].shape, generator=torch.Generator().manual_seed(50 + g))
        d["teacher_logp"] = (torch.roll(d["logprobs"], -1, dims=-1) + 0.3 * noise) * d["attention_mask"]
        d["rl_loss_weight"] = RL_WEIGHT if kind == "joint" else 0.0
        d["distill_loss_weight"] = DISTILL_WEIGHT


def critic_batch(actor, critic, mine: list, pick: list) -> list:
    """The critic's batch as AReaL's trainer makes it: ``values`` from the critic's own
    ``compute_values`` (moved by fixed noise per group: V_old is the critic's before the update,
    and the clip should bind on part of the tokens), then the actor's ``compute_advantages``
    (``returns = advantages + values``, the rolled loss mask)."""
    configure(actor, _case("plain", "token_mean", "1mb"))
    data = [dict(d) for d in mine]
    for d, g, values in zip(data, pick, critic.compute_values(data)):
        noise = torch.randn(values.shape, generator=torch.Generator().manual_seed(70 + g))
        d["values"] = (values.float() + VALUE_NOISE * noise) * d["attention_mask"]
    return actor.compute_advantages(data)


def configure_critic(critic, case: dict) -> None:
    from areal.api.cli_args import MicroBatchSpec

    from megatron_pg_agg.integrations.areal.plugin import ArealSettings
    from megatron_pg_agg.integrations.objective import HostObjective

    critic.config.mb_spec = MicroBatchSpec(**SPLITS[case["split"]])
    critic.config.ppo_n_minibatches = case["ppo_n_minibatches"]  # PPOCritic reads the same config object
    critic.pg_agg_settings = ArealSettings(HostObjective(case["mode"], DIVISOR if case["mode"] == "constant" else None),
                                           value_mode=case["value_mode"])


def run_critic_case(critic, probe, case, data, run, values, results) -> None:
    from areal.engine.megatron_engine import MegatronPPOCritic

    t1 = time.monotonic()
    configure_critic(critic, case)
    batch = [dict(d) for d in data]
    probe.captured.clear()
    if case["kind"] == "plugin":
        critic.ppo_update(batch)
    else:  # the plug-in off: AReaL's own critic update (no group marks, its own loss)
        MegatronPPOCritic.ppo_update(critic, batch)
    critic.export_stats()
    by_group, gathered = run.gather(data, _critic_row, run.step_groups(data, case, "critic.ppo_n_minibatches"))
    if run.rank != 0:
        return
    mode = case["value_mode"] or case["mode"]
    steps = []
    for k, flat in enumerate(probe.captured):
        members = sorted(g for _, _, sg in gathered for g in sg[k])
        ref, ref_grad, clipped = values.step(mode, [(g, r) for g in members for r in by_group[g]])
        steps.append(dict(objective=flat["objective"], groups=members, grad_norm=float(flat["grad"].norm()),
                          reference=ref, grad_error=values.grad_error(flat["grad"], ref_grad), clipped=clipped))
    results[case["name"]] = dict(case=case, steps=steps, seconds=time.monotonic() - t1)
    _print(case, steps)


def trains_head(critic, probe, data, dp_group) -> dict:
    """One real optimizer step of the plug-in's critic (seq_mean, 3 micro-batches): how far the
    value head and the trunk moved, and how far the head lies apart over the DP ranks after
    (AReaL 1.0.4 alone leaves the head out of DDP: it never moves, nor is it reduced)."""
    head = _head(critic)
    before, trunk = head.detach().clone(), critic.model[0].module.decoder.final_layernorm.weight.detach().clone()
    configure_critic(critic, _case("step", "seq_mean", "3mb"))
    probe.stepping = True
    critic.ppo_update([dict(d) for d in data])
    probe.stepping = False
    critic.export_stats()
    gathered = ValueReference.head(critic, dp_group)
    return dict(head_moved=float((head.detach() - before).abs().max()),
                trunk_moved=float((critic.model[0].module.decoder.final_layernorm.weight.detach() - trunk).abs().max()),
                head_spread=max(float((g - gathered[0]).abs().max()) for g in gathered))


def _head(critic):
    return critic.model[0].module.output_layer.weight


def _row(d: dict, i: int, prompt: int) -> dict:
    """Response ``i`` of AReaL's group dict after compute_advantages, in response positions:
    AReaL's rolled fields hold at position t the values of token t+1, so response token j is
    position ``prompt + j - 1``."""
    attn = d["attention_mask"][i].bool()
    ids = d["input_ids"][i][attn].tolist()
    mask = d["loss_mask"][i][attn].float()
    n = len(ids) - prompt
    at = slice(prompt - 1, prompt - 1 + n)
    row = dict(prompt_ids=ids[:prompt], response_ids=ids[prompt:], loss_mask=mask[at].tolist(),
               advantages=d["advantages"][i][at].double().tolist(),
               old_logprobs=d["logprobs"][i][at].double().tolist())
    if "teacher_logp" in d:  # AReaL's trainer writes it per token, compared where logprobs is (rolled)
        row.update(teacher=d["teacher_logp"][i][attn][at].double().tolist(), rl_loss_weight=d["rl_loss_weight"],
                   distill_loss_weight=d["distill_loss_weight"])
    return row


def _critic_row(d: dict, i: int, prompt: int) -> dict:
    """Response ``i`` of the critic's group dict, in response positions (as :func:`_row`): the
    value at position ``prompt + j - 1`` is the state before response token j."""
    attn = d["attention_mask"][i].bool()
    ids = d["input_ids"][i][attn].tolist()
    n = len(ids) - prompt
    at = slice(prompt - 1, prompt - 1 + n)
    return dict(prompt_ids=ids[:prompt], response_ids=ids[prompt:],
                loss_mask=d["loss_mask"][i][attn].float()[at].tolist(),
                old_values=d["values"][i][attn][at].double().tolist(),
                returns=d["returns"][i][attn][at].double().tolist())


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
        teacher = case.get("teacher")
        value = torch.zeros((), dtype=torch.float64)
        if teacher != "pure":  # AReaL's pure KD discards the PG term
            value, _ = step_objective(lambda ids: self.model(torch.tensor([ids])).logits[0], rollouts, cfg)
            value = value * (RL_WEIGHT if teacher == "joint" else 1.0)
        if teacher:
            value = value + DISTILL_WEIGHT * self.distill_mean(rollouts, pure=teacher == "pure")
        value.backward()
        return float(value), {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}

    def distill_mean(self, rollouts, *, pure: bool):
        """AReaL's KD term, float64, its token mean over the step's valid tokens: per response token j
        (scored at position P + j - 1) ``logp_j - teacher_j`` (joint), or
        ``-exp(logp_j - old_j) (teacher_j - sg(logp_j))`` (pure KD)."""
        total, tokens = torch.zeros((), dtype=torch.float64), 0
        for r in rollouts:
            ids = list(r.prompt_ids) + list(r.response_ids)
            logits = self.model(torch.tensor([ids])).logits[0].double()
            p = len(r.prompt_ids)
            for j, token in enumerate(r.response_ids):
                if not r.loss_mask[j]:
                    continue
                logp = torch.log_softmax(logits[p + j - 1], dim=-1)[token]
                if pure:
                    total = total - torch.exp(logp - r.old_logprobs[j]) * (r.teacher[j] - logp.detach())
                else:
                    total = total + logp - r.teacher[j]
                tokens += 1
        return total / max(tokens, 1)

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


class ValueReference:
    """The critic's reference: transformers' float64 model of DIR (the actor Reference's) for the
    trunk, its final hidden states times the critic's value-head weight (read from the Megatron
    model, a float64 leaf), AReaL's clipped squared error (0.5, ``critic.eps_clip``) and the mode's
    formula written here; the engine's trunk gradient exported to HF names by the critic's own mbridge."""

    def __init__(self, reference: Reference, critic, heads: list, names: list, numels: list):
        self.model, self.critic, self.names, self.numels = reference.model, critic, names, numels
        assert all(torch.equal(h, heads[0]) for h in heads), "the value head differs over the DP ranks"
        self.weight = heads[0].reshape(-1).double().requires_grad_(True)

    @staticmethod
    def head(critic, dp_group) -> list:
        """Every DP rank's value-head weight (a collective over ``dp_group``)."""
        import torch.distributed as dist

        mine = _head(critic).detach().clone()
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(dp_group))]
        dist.all_gather(gathered, mine, group=dp_group)
        return gathered

    def step(self, mode: str, members: list) -> tuple:
        """``(J_v, HF parameter gradients with the head's, tokens on the clipped branch)``."""
        units, clipped = [], 0
        self.model.zero_grad(set_to_none=True)
        self.weight.grad = None
        for g, r in members:
            ids = r["prompt_ids"] + r["response_ids"]
            hidden = self.model.model(input_ids=torch.tensor([ids])).last_hidden_state[0].double()
            values = hidden @ self.weight
            p, total, tokens = len(r["prompt_ids"]), torch.zeros((), dtype=torch.float64), 0
            for j in range(len(r["response_ids"])):
                if not r["loss_mask"][j]:
                    continue
                v, old, ret = values[p + j - 1], r["old_values"][j], r["returns"][j]
                unclipped, wide = (v - ret) ** 2, (torch.clamp(v, old - VALUE_EPS, old + VALUE_EPS) - ret) ** 2
                clipped += int(wide > unclipped)
                total, tokens = total + 0.5 * torch.maximum(unclipped, wide), tokens + 1
            units.append((g, total, tokens))
        value = _mode_mean(units, mode)
        value.backward()
        grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                 for n, p in self.model.named_parameters() if n != "lm_head.weight"}  # the LM head is not the critic's
        grads["value_head"] = self.weight.grad.detach().clone()
        return float(value), grads, clipped

    def grad_error(self, flat: torch.Tensor, ref_grad: dict) -> float:
        """|g - g_ref| / |g_ref| over the trunk (the engine's gradient exported to HF names by mbridge;
        its ``lm_head.weight`` is the value head) and the value head (``output_layer.weight``)."""
        params = {}
        for chunk in self.critic.model:
            params.update(dict(chunk.module.named_parameters()))
        saved = {n: params[n].data.clone() for n in self.names}
        parts = dict(zip(self.names, torch.split(flat, self.numels)))
        for name, part in parts.items():
            params[name].data.copy_(part.view_as(params[name]))
        try:
            exported = {n: t.detach().double().cpu() for n, t in self.critic.bridge.export_weights(self.critic.model)
                        if n != "lm_head.weight"}
        finally:
            for n in self.names:
                params[n].data.copy_(saved[n])
        exported["value_head"] = parts["output_layer.weight"].double().reshape(-1)
        assert set(exported) == set(ref_grad), sorted(set(exported) ^ set(ref_grad))[:8]
        diff = sum(float((exported[n] - ref_grad[n]).pow(2).sum()) for n in ref_grad) ** 0.5
        norm = sum(float(g.pow(2).sum()) for g in ref_grad.values()) ** 0.5
        return diff / norm


def _mode_mean(units: list, mode: str):
    """The README's modes on per-response ``(group, N_s, D_s)``: token_mean sum N / sum D; seq_mean
    mean over active responses of N_s / D_s; prompt_mean mean over active groups of pooled N_g / D_g;
    constant sum N / (active responses * L)."""
    zero = torch.zeros((), dtype=torch.float64)
    active = [(n, d) for _, n, d in units if d > 0]
    if mode == "token_mean":
        return sum((n for _, n, _ in units), zero) / max(sum(d for _, _, d in units), 1)
    if mode == "seq_mean":
        return sum((n / d for n, d in active), zero) / max(len(active), 1)
    if mode == "constant":
        return sum((n for n, _ in active), zero) / (max(len(active), 1) * DIVISOR)
    pooled = {}
    for g, n, d in units:
        acc = pooled.setdefault(g, [zero, 0])
        acc[0], acc[1] = acc[0] + n, acc[1] + d
    groups = [(n, d) for n, d in pooled.values() if d > 0]
    return sum((n / d for n, d in groups), zero) / max(len(groups), 1)


if __name__ == "__main__":
    main(sys.argv[1:])

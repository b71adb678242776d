"""verl 0.9.1's own Megatron engine with the plug-in's loss, against a float64 reference (torchrun).

    torchrun --nproc-per-node {1,2} -m tests.distributed.workers.verl_checks HF_FOLDER OUT.json

Every rank builds verl's engine through its own ``EngineRegistry.new(...).initialize()``
(Megatron-Bridge loads the HF folder) twice: without and with ``calculate_per_token_loss``. One
mini-batch of 16 ragged responses in 4 prompt groups of 5, 4, 4 and 3 (the DP split cuts the
second group across the ranks; one response is fully masked, another has a masked token) is trained
through ``MegatronEngine.forward_backward_batch`` under each case: mode, policy loss, rollout
correction, KL and entropy terms, the response fields padded or jagged, micro-batch size 1, 2 or
4, or verl's dynamic batch size. The loss is the one the plug-in sets on verl's actor worker
(``worker_loss``), on verl's own ``McoreActorConfig``.

The reference: transformers' float64 model of the same folder, ``megatron_pg_agg.parity.
step_objective`` (the README's formulas, no package loss or aggregation code), its autograd
gradient. The engine's gradients (``main_grad`` after verl's schedule, DDP and
``finalize_model_grads``) are exported to HF names through Megatron-Bridge's own mapping (the
mapping is linear: a gradient maps as its weight). Rank 0 writes one row per case.

The control runs verl's own ``ppo_loss`` (``vanilla``) with ``seq-mean-token-sum-norm`` and
``token-mean``. Last, ``train_batch`` (zero_grad, forward-backward, verl's Megatron optimizer step)
once per engine: its grad norm against the reference's, and the weights moved.

The critic (issue 46): verl's engine with its value head (``model_type="value_model"``, the head at
verl's random initialisation, the same on every DP rank), twice (without and with
``calculate_per_token_loss``; one value head), on the same mini-batch with ``values`` (V_old) and
``returns`` near the model's own values. The loss is the one verl's critic worker ends up with:
verl's ``partial(value_loss, config=McoreCriticConfig(loss_agg_mode=<mode>))`` through the
plug-in's ``TrainingWorker.set_loss_fn``. Every mode x four splits (padded mbs 2, jagged mbs 1,
jagged dynamic; jagged mbs 4 with per-token loss) against :func:`value_reference` (float64, the
formulas, the head's weight read from the engine); the control runs verl's own ``value_loss`` with
``token-mean`` and ``seq-mean-token-sum-norm``; ``train_batch`` once.
"""
from __future__ import annotations

import json
import math
import sys
from types import SimpleNamespace

import torch

GROUPS = (5, 4, 4, 3)
PROMPT_LENGTHS = (3, 5, 4, 2, 5, 1, 3, 4, 2, 5, 3, 1, 4, 2, 3, 5)
RESPONSE_LENGTHS = (7, 2, 5, 1, 6, 3, 7, 4, 5, 2, 6, 3, 7, 1, 4, 6)
FULLY_MASKED, MASKED_TOKEN = 3, (1, 1)
DIVISOR = 7.0
CORRECTION_CAP = 1.2
VALUE_CLIP = 0.2  # critic.cliprange_value


def make_rows(hf_model, vocab: int):
    """The mini-batch as plain Python rows (all ranks the same), old/rollout/ref log-probs near the
    model's own so that clipping and the corrections are partly active."""
    g = torch.Generator().manual_seed(11)
    rows, uid = [], 0
    for size in GROUPS:
        for _ in range(size):
            i = len(rows)
            prompt = torch.randint(1, vocab, (PROMPT_LENGTHS[i],), generator=g).tolist()
            response = torch.randint(1, vocab, (RESPONSE_LENGTHS[i],), generator=g).tolist()
            mask = [1] * len(response)
            if i == FULLY_MASKED:
                mask = [0] * len(response)
            if i == MASKED_TOKEN[0]:
                mask[MASKED_TOKEN[1]] = 0
            rows.append(SimpleNamespace(group_id=f"g{uid}", prompt_ids=prompt, response_ids=response, loss_mask=mask,
                                        numerator_mask=None, advantage=float(torch.randn((), generator=g))))
        uid += 1
    with torch.no_grad():
        for r in rows:
            logits = hf_model(torch.tensor([r.prompt_ids + r.response_ids])).logits[0]
            logp = torch.log_softmax(logits, -1)
            p = len(r.prompt_ids)
            true = [float(logp[p + j - 1, t]) for j, t in enumerate(r.response_ids)]
            noise = [(s * torch.randn(len(true), generator=g, dtype=torch.float64)).tolist() for s in (0.3, 0.3, 0.2)]
            r.old_logprobs = [a + b for a, b in zip(true, noise[0])]
            r.rollout_logprobs = [a + b for a, b in zip(r.old_logprobs, noise[1])]
            r.ref_logprobs = [a + b for a, b in zip(true, noise[2])]
            r.is_weights = [0.5 + 0.1 * k for k in range(len(true))]
            r.advantages = [r.advantage] * len(true)
    return rows


def corrected(rows, kind: str):
    """The rollout corrections written here from their definitions (docs/policy-losses.md), for the
    reference: token_truncate ``w = min(exp(old - rollout), C)``; sequence_mask drops a response
    whose ``exp(mean over valid tokens of (old - rollout))`` is outside ``[0, C]``."""
    out = []
    for r in rows:
        valid = [j for j, m in enumerate(r.loss_mask) if m]
        delta = [r.old_logprobs[j] - r.rollout_logprobs[j] for j in range(len(r.loss_mask))]
        new = SimpleNamespace(**vars(r))
        if kind == "token_truncate":
            new.pg_weights = [min(math.exp(d), CORRECTION_CAP) for d in delta]
        elif kind == "sequence_mask":
            mean = sum(delta[j] for j in valid) / len(valid) if valid else 0.0
            keep = math.exp(mean) <= CORRECTION_CAP
            new.numerator_mask = [bool(m) and keep for m in r.loss_mask]
        elif kind == "verl_is":
            new.pg_weights = list(r.is_weights)
        out.append(new)
    return out


def batch(rows, mine, *, jagged: bool, mbs: int, dynamic: bool, fields=()):
    """This rank's rows as verl's trainer hands them to the engine: padded to the whole batch's
    widths, ``left_right_2_no_padding``, then (jagged) the response fields as nested tensors."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    P = max(len(r.prompt_ids) for r in rows)
    R = max(len(r.response_ids) for r in rows)
    sel = [rows[i] for i in mine]
    B = len(sel)
    prompts, responses = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, R, dtype=torch.long)
    attention = torch.zeros(B, P + R, dtype=torch.long)
    per_token = {name: torch.zeros(B, R) for name in ("response_mask", "old_log_probs", "advantages", *fields)}
    source = {"response_mask": "loss_mask", "old_log_probs": "old_logprobs", "advantages": "advantages",
              "rollout_log_probs": "rollout_logprobs", "ref_log_prob": "ref_logprobs",
              "rollout_is_weights": "is_weights", "values": "old_values", "returns": "returns"}
    for i, r in enumerate(sel):
        p, n = len(r.prompt_ids), len(r.response_ids)
        prompts[i, P - p:] = torch.tensor(r.prompt_ids)
        responses[i, :n] = torch.tensor(r.response_ids)
        attention[i, P - p:P + n] = 1
        for name, tensor in per_token.items():
            tensor[i, :n] = torch.tensor(getattr(r, source[name]), dtype=torch.float32)
    td = TensorDict({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                     "attention_mask": attention, "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
                     **per_token}, batch_size=[B])
    tu.assign_non_tensor(td, uid=[r.group_id for r in sel])
    td = left_right_2_no_padding(td)
    if jagged:
        lengths = torch.tensor([len(r.response_ids) for r in sel])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        for name in per_token:
            dense = td[name]
            values = torch.cat([dense[i, :int(lengths[i])] for i in range(B)])
            td[name] = torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
        td["loss_mask"] = td["response_mask"]
        # verl's v1 (jagged) layout: prompts and responses nested too, so that verl pads each
        # micro-batch's responses to its own longest one
        p_lengths = torch.tensor([len(r.prompt_ids) for r in sel])
        p_offsets = torch.cat([torch.zeros(1, dtype=torch.long), p_lengths.cumsum(0)])
        td["prompts"] = torch.nested.nested_tensor_from_jagged(
            torch.cat([torch.tensor(r.prompt_ids) for r in sel]), offsets=p_offsets)
        td["responses"] = torch.nested.nested_tensor_from_jagged(
            torch.cat([torch.tensor(r.response_ids) for r in sel]), offsets=offsets)
        tu.assign_non_tensor(td, max_response_len=-1)
    tu.assign_non_tensor(td, temperature=1.0, global_batch_size=len(rows), micro_batch_size_per_gpu=mbs,
                         use_dynamic_bsz=dynamic, max_token_len_per_gpu=24, use_remove_padding=True,
                         use_fused_kernels=False, calculate_entropy="ref_log_prob" in fields)
    return td


def actor_config(loss_mode: str, **overrides):
    """verl's own McoreActorConfig (its __post_init__ checks run)."""
    from verl.workers.config import McoreActorConfig, PolicyLossConfig

    return McoreActorConfig(strategy="megatron", rollout_n=4, ppo_mini_batch_size=16, ppo_micro_batch_size_per_gpu=2,
                            policy_loss=PolicyLossConfig(loss_mode=loss_mode), **overrides)


def hf_grads(engine) -> dict:
    """The engine's gradients in HF names, through Megatron-Bridge's export mapping."""
    from megatron.core.utils import unwrap_model

    chunks = unwrap_model(list(engine.module))
    params = [p for c in chunks for p in c.parameters()]
    saved = [p.data for p in params]
    for p in params:
        p.data = p.main_grad.to(p.dtype)
    try:
        return {name: t.double().clone() for name, t in
                engine.bridge.export_hf_weights(chunks, cpu=True, show_progress=False)}
    finally:
        for p, d in zip(params, saved):
            p.data = d


def compare(grads: dict, ref: dict) -> tuple:
    num = sum(float(((grads[k] - ref[k]) ** 2).sum()) for k in ref)
    den = sum(float((ref[k] ** 2).sum()) for k in ref)
    missing = sorted(set(ref) - set(grads))
    assert not missing, f"no engine gradient for {missing[:5]}"
    return math.sqrt(num / den) if den else math.sqrt(num), math.sqrt(den)


def head_weight(engine) -> torch.Tensor:
    """verl's value head (``output_layer``, hidden -> 1) of a critic engine."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(list(engine.module))[0].output_layer.weight


def model_values(hf_model, head: torch.Tensor, r) -> torch.Tensor:
    """V at each response token of row ``r``: the value head on the final hidden state of the token
    before it (verl's alignment, ``no_padding_2_padding``), float64."""
    ids = list(r.prompt_ids) + list(r.response_ids)
    hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0]
    p, n = len(r.prompt_ids), len(r.response_ids)
    return hidden[p - 1:p + n - 1] @ head.reshape(-1)


def add_value_targets(rows, hf_model, head: torch.Tensor) -> None:
    """V_old and R per response token, near the model's own V (the clip partly active), as float32
    numbers (what the batch carries)."""
    g = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for r in rows:
            v = model_values(hf_model, head, r)
            r.old_values = (v + 0.3 * torch.randn(len(v), generator=g, dtype=torch.float64)).float().double().tolist()
            r.returns = (v + 0.5 * torch.randn(len(v), generator=g, dtype=torch.float64)).float().double().tolist()


def value_reference(hf_model, head: torch.Tensor, rows, mode: str, divisor) -> tuple:
    """J_v and its gradient from the formulas, float64: ``v = 0.5 max((V - R)^2, (clamp(V, V_old -
    eps, V_old + eps) - R)^2)`` per response token, aggregated by tests/support/reference.py (the
    README's contract written with loops, no package code). The value head's gradient is keyed as
    Megatron-Bridge exports the critic's output layer (``lm_head.weight``, ``[1, hidden]``)."""
    from tests.support.reference import reference_objective

    hf_model.zero_grad(set_to_none=True)
    head = head.detach().double().clone().requires_grad_(True)
    losses, mask = [], []
    for r in rows:
        v = model_values(hf_model, head, r)
        old, ret = torch.tensor(r.old_values, dtype=torch.float64), torch.tensor(r.returns, dtype=torch.float64)
        clipped = torch.minimum(torch.maximum(v, old - VALUE_CLIP), old + VALUE_CLIP)
        losses.append(0.5 * torch.maximum((v - ret) ** 2, (clipped - ret) ** 2))
        mask += [bool(m) for m in r.loss_mask]
    mask = torch.tensor(mask)
    objective, weight = reference_objective(torch.cat(losses), mask, mask, [len(r.response_ids) for r in rows],
                                            list(GROUPS), mode, divisor)
    objective.backward()
    grads = {n: p.grad.detach().clone() for n, p in hf_model.named_parameters() if p.grad is not None}
    grads["lm_head.weight"] = head.grad.reshape(1, -1)
    return float(objective), weight, grads


def critic_config(agg: str, **overrides):
    """verl's own McoreCriticConfig (its __post_init__ checks run)."""
    from verl.workers.config import McoreCriticConfig

    return McoreCriticConfig(ppo_micro_batch_size_per_gpu=2, rollout_n=4, ppo_mini_batch_size=4, loss_agg_mode=agg,
                             cliprange_value=VALUE_CLIP, **overrides)


def critic_loss_through_the_worker(engine, agg: str, **overrides):
    """The loss verl's critic worker ends up with: verl's ``partial(value_loss, config=CriticConfig)``
    handed to its (patched) ``TrainingWorker.set_loss_fn``."""
    from functools import partial

    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import value_loss

    worker = SimpleNamespace(engine=engine)
    TrainingWorker.set_loss_fn(worker, partial(value_loss, config=critic_config(agg, **overrides)))
    return worker.loss_fn


CRITIC_SPLITS = (("thd", False, 2, False), ("thd", True, 1, False), ("thd", True, 1, True),
                 ("thd_per_token", True, 4, False))
"""(engine, jagged, micro-batch size, dynamic): three splits on verl's default critic engine
(dynamic by tokens is what verl 0.9.1's critic runs whatever critic.use_dynamic_bsz says, #7462;
here every split is set explicitly per call) and one with calculate_per_token_loss."""


def critic_checks(hf_path, hf_model, rows, mine, run, objective_of) -> dict:
    """verl's critic engine (``model_type="value_model"``) under the plug-in's critic loss in every
    mode and split, against :func:`value_reference`; the control (verl's own value_loss, plug-in
    off); verl's train_batch once."""
    from tests.distributed.workers.verl_cpu import build_engine

    world = torch.distributed.get_world_size()
    engines = {"thd": build_engine(hf_path, per_token_loss=False, model_type="value_model"),
               "thd_per_token": build_engine(hf_path, per_token_loss=True, model_type="value_model")}
    head = head_weight(engines["thd"])
    with torch.no_grad():  # one critic: the second engine gets the first one's (random) value head
        head_weight(engines["thd_per_token"]).copy_(head)
    gathered = [torch.zeros_like(head) for _ in range(world)]
    torch.distributed.all_gather(gathered, head.detach().contiguous())
    assert all(torch.equal(gathered[0], h) for h in gathered), "verl's value head differs across DP ranks"
    add_value_targets(rows, hf_model, head.detach().double())
    refs = {mode: value_reference(hf_model, head, rows, mode, DIVISOR if mode == "constant" else None)
            for mode in ("token_mean", "seq_mean", "prompt_mean", "constant")}
    fields = ("values", "returns")
    cases, control = [], []
    for mode, ref in refs.items():
        overrides = {"loss_scale_factor": int(DIVISOR)} if mode == "constant" else {}
        for engine_name, jagged, mbs, dynamic in CRITIC_SPLITS:
            loss = critic_loss_through_the_worker(engines[engine_name], mode, **overrides)
            assert type(loss).__name__ == "VerlValueLoss", type(loss)
            out = run(engines[engine_name], batch(rows, mine, jagged=jagged, mbs=mbs, dynamic=dynamic, fields=fields),
                      loss)
            j = objective_of(out, "critic/vf_loss") / world  # the metric carries verl's x dp_size
            rel, _ = compare(out["hf_grads"], ref[2])
            cases.append({"case": f"critic {mode} {engine_name} {'jagged' if jagged else 'padded'} "
                                  f"{'dynamic' if dynamic else f'mbs={mbs}'}", "mode": mode, "engine": engine_name,
                          "split": "dynamic" if dynamic else mbs, "objective": j, "reference": ref[0],
                          "objective_error": abs(j - ref[0]) / max(abs(ref[0]), 0.01), "grad_rel_error": rel,
                          "clip_fraction": objective_of(out, "critic/vf_clipfrac") / world})
    from functools import partial

    from verl.workers.utils.losses import value_loss

    for agg, splits in (("token-mean", ((True, 1, False), (True, 4, False), (True, 1, True))),
                        ("seq-mean-token-sum-norm", ((True, 1, False), (True, 2, False), (True, 4, False)))):
        for jagged, mbs, dynamic in splits:
            out = run(engines["thd"], batch(rows, mine, jagged=jagged, mbs=mbs, dynamic=dynamic, fields=fields),
                      partial(value_loss, config=critic_config(agg)))
            row = {"verl_loss_agg_mode": agg, "split": "dynamic" if dynamic else mbs,
                   "objective": objective_of(out, "critic/vf_loss") / world}
            if agg == "token-mean":
                row["grad_rel_error"] = compare(out["hf_grads"], refs["token_mean"][2])[0]
                row["reference"] = refs["token_mean"][0]
            control.append(row)
    step = train_step(engines["thd"], critic_loss_through_the_worker(engines["thd"], "prompt_mean"),
                      batch(rows, mine, jagged=True, mbs=2, dynamic=False, fields=fields), refs["prompt_mean"][2])
    return {"critic": cases, "critic_control": control, "critic_train_batch": step}


def train_step(engine, loss, td, ref_grads) -> dict:
    """verl's train_batch (zero_grad, forward-backward, its Megatron optimizer step; clip_grad 0):
    its grad norm against the reference's, and how far the weights moved."""
    before = [p.detach().clone() for m in engine.module for p in m.parameters()]
    with engine.train_mode():
        out = engine.train_batch(td, loss)
    after = [p.detach() for m in engine.module for p in m.parameters()]
    grad_norm = out["metrics"].get("grad_norm") if out.get("metrics") else None
    return {"grad_norm": None if grad_norm is None else float(grad_norm),
            "grad_norm_reference": compare(ref_grads, ref_grads)[1],
            "weights_moved": max(float((a - b).abs().max()) for a, b in zip(after, before))}


def main() -> None:
    hf_path, out_path = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    from tests.distributed.workers.verl_cpu import build_engine, setup_cpu

    setup_cpu()
    from functools import partial

    from transformers import AutoModelForCausalLM
    from verl.workers.utils.losses import ppo_loss

    from megatron_pg_agg.core.losses import PGLossConfig
    from megatron_pg_agg.integrations.verl.worker_losses import worker_loss
    from megatron_pg_agg.parity import step_objective

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    hf_model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float64)
    rows = make_rows(hf_model, hf_model.config.vocab_size)
    per = len(rows) // world
    mine = list(range(rank * per, (rank + 1) * per))

    def forward_logits(ids):
        return hf_model(torch.tensor([ids])).logits[0]

    references = {}

    def reference(key, cfg, ref_rows):
        if key not in references:
            hf_model.zero_grad(set_to_none=True)
            objective, weight = step_objective(forward_logits, ref_rows, cfg)
            objective.backward()
            references[key] = (float(objective), weight,
                               {n: p.grad.detach().clone() for n, p in hf_model.named_parameters()
                                if p.grad is not None})
        return references[key]

    results = []
    engines = {"thd": build_engine(hf_path, per_token_loss=False),
               "thd_per_token": build_engine(hf_path, per_token_loss=True)}

    def run(engine, td, loss):
        """One forward-backward; the gradients are read inside verl's train-mode context (its exit
        zeroes them)."""
        with engine.train_mode():
            engine.optimizer_zero_grad()
            out = engine.forward_backward_batch(td, loss)
            out["hf_grads"] = hf_grads(engine)
        return out

    def objective_of(out, key):
        total = torch.tensor(float(sum(float(v) for v in out["metrics"][key].values)) if out.get("metrics") else 0.0,
                             dtype=torch.float64)
        torch.distributed.all_reduce(total)
        return float(total)

    def record(name, engine_name, out, key, ref, **extra):
        j = objective_of(out, "actor/pg_agg_objective") / world  # the metric carries verl's x dp_size
        rel, ref_norm = compare(out["hf_grads"], ref[2])
        results.append({"case": name, "engine": engine_name, "world": world, "objective": j, "reference": ref[0],
                        "objective_error": abs(j - ref[0]), "grad_rel_error": rel, "grad_norm_reference": ref_norm,
                        **extra})

    modes = {"token_mean": {}, "seq_mean": {}, "prompt_mean": {}, "constant": {"divisor": DIVISOR}}
    for mode, extra in modes.items():
        cfg = PGLossConfig(mode=mode, dual_clip=3.0, **extra)
        ref = reference((mode, "ppo"), cfg, rows)
        loss = worker_loss({"actor": actor_config("pg_agg"), "pg_agg": {"mode": mode, **extra}})
        for jagged in (False, True):
            for mbs in (1, 2, 4):
                out = run(engines["thd"], batch(rows, mine, jagged=jagged, mbs=mbs, dynamic=False), loss)
                record(f"{mode} {'jagged' if jagged else 'padded'} mbs={mbs}", "thd", out, mode, ref,
                       mode=mode, layout="jagged" if jagged else "padded", mbs=mbs)
        out = run(engines["thd"], batch(rows, mine, jagged=True, mbs=1, dynamic=True), loss)
        record(f"{mode} jagged dynamic", "thd", out, mode, ref, mode=mode, layout="jagged", mbs="dynamic")
        for mbs, dynamic in ((1, False), (4, False), (1, True)):
            out = run(engines["thd_per_token"], batch(rows, mine, jagged=True, mbs=mbs, dynamic=dynamic), loss)
            record(f"{mode} per-token-loss jagged {'dynamic' if dynamic else f'mbs={mbs}'}", "thd_per_token", out,
                   mode, ref, mode=mode, layout="jagged", mbs="dynamic" if dynamic else mbs)
    for policy in ("gspo", "gmpo", "cispo"):
        cfg = PGLossConfig(mode="prompt_mean", policy_loss=policy)
        ref = reference(("prompt_mean", policy), cfg, rows)
        loss = worker_loss({"actor": actor_config("pg_agg"), "pg_agg": {"mode": "prompt_mean", "policy_loss": policy}})
        for jagged, mbs in ((False, 4), (True, 2)):
            out = run(engines["thd"], batch(rows, mine, jagged=jagged, mbs=mbs, dynamic=False), loss)
            record(f"{policy} prompt_mean {'jagged' if jagged else 'padded'} mbs={mbs}", "thd", out, policy, ref,
                   mode="prompt_mean", policy_loss=policy, layout="jagged" if jagged else "padded", mbs=mbs)
    for kind in ("token_truncate", "sequence_mask", "verl_is"):
        cfg = PGLossConfig(mode="seq_mean", dual_clip=3.0)
        ref = reference(("seq_mean", kind), cfg, corrected(rows, kind))
        block = {"mode": "seq_mean"} if kind == "verl_is" else \
            {"mode": "seq_mean", "rollout_correction": kind, "rollout_correction_max": CORRECTION_CAP}
        field = "rollout_is_weights" if kind == "verl_is" else "rollout_log_probs"
        loss = worker_loss({"actor": actor_config("pg_agg"), "pg_agg": block})
        out = run(engines["thd"], batch(rows, mine, jagged=True, mbs=2, dynamic=False, fields=(field,)), loss)
        record(f"correction {kind} seq_mean jagged mbs=2", "thd", out, kind, ref, mode="seq_mean", correction=kind)
    # KL and entropy terms (verl's use_kl_loss / kl_loss_type / entropy_coeff)
    cfg = PGLossConfig(mode="prompt_mean", dual_clip=3.0, kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01)
    ref = reference(("prompt_mean", "kl+entropy"), cfg, rows)
    loss = worker_loss({"actor": actor_config("pg_agg", use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="low_var_kl",
                                              entropy_coeff=0.01), "pg_agg": {"mode": "prompt_mean"}})
    out = run(engines["thd"], batch(rows, mine, jagged=True, mbs=2, dynamic=False, fields=("ref_log_prob",)), loss)
    record("prompt_mean + kl(low_var_kl) + entropy jagged mbs=2", "thd", out, "kl", ref, mode="prompt_mean")

    # the control: verl's own loss
    control = []
    for agg, extra in (("seq-mean-token-sum-norm", {}), ("token-mean", {})):
        verl_loss = partial(ppo_loss, config=actor_config("vanilla", loss_agg_mode=agg, **extra))
        for mbs in (1, 2, 4):
            out = run(engines["thd"], batch(rows, mine, jagged=True, mbs=mbs, dynamic=False), verl_loss)
            j = objective_of(out, "actor/pg_loss") / world  # verl's pg_loss carries its x dp_size
            row = {"verl_loss_agg_mode": agg, "mbs": mbs, "objective": j}
            if agg == "token-mean":
                ref = reference(("token_mean", "ppo"), PGLossConfig(mode="token_mean", dual_clip=3.0), rows)
                row["grad_rel_error"] = compare(out["hf_grads"], ref[2])[0]
                row["reference"] = ref[0]
            control.append(row)

    # train_batch: verl's zero_grad, forward-backward and optimizer step; clip_grad 0 (no clipping)
    steps = []
    for engine_name, engine in engines.items():
        ref = reference(("prompt_mean", "ppo"), PGLossConfig(mode="prompt_mean", dual_clip=3.0), rows)
        loss = worker_loss({"actor": actor_config("pg_agg"), "pg_agg": {"mode": "prompt_mean"}})
        before = [p.detach().clone() for m in engine.module for p in m.parameters()]
        with engine.train_mode():
            out = engine.train_batch(batch(rows, mine, jagged=True, mbs=2, dynamic=False), loss)
        after = [p.detach() for m in engine.module for p in m.parameters()]
        moved = max(float((a - b).abs().max()) for a, b in zip(after, before))
        grad_norm = out["metrics"].get("grad_norm") if out.get("metrics") else None
        steps.append({"engine": engine_name, "grad_norm": None if grad_norm is None else float(grad_norm),
                      "grad_norm_reference": compare({k: v for k, v in ref[2].items()}, ref[2])[1],
                      "weights_moved": moved})
    critic = critic_checks(hf_path, hf_model, rows, mine, run, objective_of)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world": world, "cases": results, "control": control, "train_batch": steps, **critic}, f,
                      indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

"""Independent single-process reference for the first-step objective of the Megatron-LM runs.

    python -m tests.distributed.workers.megatron_lm_reference CHECKOUT OUT.json -- <the runs' Megatron-LM flags>

Loads the runs' initial checkpoint with Megatron-LM's own ``load_checkpoint`` (the flags carry
``--load DIR --finetune``), forwards every response of rollout step 0 ALONE (no packing, no
planner, no microbatches, no parallelism), and computes each mode's objective in float64 with
plain per-sequence Python sums written from the README's contract. Nothing of the package's loss,
aggregation or planning code is used: only the model infrastructure (the CPU patches, and the
core attention that builds an explicit causal mask) and the synthetic rollout generator (data).
Writes ``{mode: objective}`` for token_mean, seq_mean, prompt_mean and constant (divisor from
``--pg-loss-aggregation-divisor``), plus the flags' clip/KL/entropy settings it used.
"""
from __future__ import annotations

import json
import math
import os
import sys
from functools import partial


def main() -> None:
    checkout, out_path = sys.argv[1], sys.argv[2]
    net, args = _load_model(checkout, sys.argv[sys.argv.index("--") + 1:])
    from megatron_pg_agg.data.synthetic import synthetic_rollouts

    rollouts = synthetic_rollouts(vocab_size=args.vocab_size, seed=args.seed)[0]
    with open(out_path, "w") as f:
        json.dump(_objectives(_per_token_terms(net, rollouts, args), args), f)


def _load_model(checkout: str, flags: list):
    """Megatron-LM's own model at the checkpoint the flags' ``--load`` names, one CPU process;
    returns ``(model, Megatron-LM's args)``."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      CUDA_DEVICE_MAX_CONNECTIONS="1")
    from megatron_pg_agg.megatron.parallel import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    sys.path.insert(0, checkout)
    from megatron_pg_agg.patches import apply_megatron_patches
    from megatron_pg_agg.patches._megatron_lm_release import check_checkout

    apply_megatron_patches(cpu_gloo=True, megatron_lm_cpu=True)
    release = check_checkout()

    from gpt_builders import gpt_builder
    from megatron.training import get_args
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import get_model
    from model_provider import model_provider

    from megatron_pg_agg.megatron.thd_attention import use_thd_core_attention
    from megatron_pg_agg.training.megatron_lm import ARGS_DEFAULTS, add_actor_args

    sys.argv = [sys.argv[0], *flags]
    if release.uses_config_container:  # core_v0.18+: the flags are parsed before initialisation
        from megatron.training.arguments import parse_and_validate_args

        parse_and_validate_args(extra_args_provider=add_actor_args, args_defaults=ARGS_DEFAULTS)
        initialize_megatron(allow_no_cuda=True)
    else:
        initialize_megatron(extra_args_provider=add_actor_args, args_defaults=ARGS_DEFAULTS, allow_no_cuda=True)
    model = get_model(partial(model_provider, gpt_builder), wrap_with_ddp=False)
    load_checkpoint(model, None, None)
    net = model[0]
    use_thd_core_attention(net)  # no packed params here: it passes an explicit causal mask
    net.eval()
    return net, get_args()


def _per_token_terms(net, rollouts, args) -> list:
    """Per response: ``(group, [(n, d, pg, kl, entropy) per response token])``, each term in float64
    Python from one unpacked forward pass of the response."""
    import torch

    eps_low = args.pg_clip_eps
    eps_high = args.pg_clip_eps_high if args.pg_clip_eps_high is not None else eps_low
    seqs = []
    with torch.no_grad():
        for r in rollouts:
            ids = list(r.prompt_ids) + list(r.response_ids)
            tokens = torch.tensor([ids])
            logits = net(input_ids=tokens, position_ids=torch.arange(len(ids))[None], attention_mask=None)
            logp_all = torch.log_softmax(logits[0].double(), dim=-1)  # [S, padded vocab]
            per_token = []
            for j, token in enumerate(r.response_ids):
                row = logp_all[len(r.prompt_ids) + j - 1]
                lp = float(row[token])
                d = int(r.loss_mask[j])
                n = d if r.numerator_mask is None else int(r.numerator_mask[j]) * d
                adv, old = float(r.advantages[j]), float(r.old_logprobs[j])
                ratio = math.exp(lp - old)
                pg = max(-adv * ratio, -adv * min(max(ratio, 1 - eps_low), 1 + eps_high))
                log_ratio = lp - float(r.ref_logprobs[j])
                kl = math.exp(-log_ratio) + log_ratio - 1.0  # k3 (the default estimator)
                entropy = -float((row.exp() * row).sum())
                per_token.append((n, d, pg, kl, entropy))
            seqs.append((r.group_id, per_token))
    return seqs


def _objectives(seqs: list, args) -> dict:
    """J in every mode from the per-token terms (the contract's formulas, written out)."""
    kl_coef, ent_coef = args.pg_kl_coef, args.pg_entropy_coef
    divisor = args.pg_loss_aggregation_divisor  # the flags name constant mode and its divisor
    tokens_d = sum(d for _, ts in seqs for _, d, _, _, _ in ts)
    extra = (kl_coef * sum(kl for _, ts in seqs for _, d, _, kl, _ in ts if d)
             - ent_coef * sum(h for _, ts in seqs for _, d, _, _, h in ts if d)) / tokens_d
    numerator = sum(pg for _, ts in seqs for n, _, pg, _, _ in ts if n)
    seq_units = [(sum(pg for n, _, pg, _, _ in ts if n), sum(d for _, d, _, _, _ in ts)) for _, ts in seqs]
    groups: dict = {}
    for (group, _), (num, den) in zip(seqs, seq_units):
        acc = groups.setdefault(group, [0.0, 0])
        acc[0] += num
        acc[1] += den
    active_seqs = [num / den for num, den in seq_units if den > 0]
    active_groups = [num / den for num, den in groups.values() if den > 0]
    return {
        "token_mean": numerator / tokens_d + extra,
        "seq_mean": sum(active_seqs) / len(active_seqs) + extra,
        "prompt_mean": sum(active_groups) / len(active_groups) + extra,
        "constant": numerator / (len(active_seqs) * divisor) + extra,
        "sequences": len(seqs), "groups": len(groups),
    }


if __name__ == "__main__":
    main()

"""Independent single-process reference for the first-step objective of the Megatron-LM runs.

    python -m tests.distributed.workers.megatron_lm_reference CHECKOUT OUT.json -- <the runs' Megatron-LM flags>

Loads the runs' initial checkpoint with Megatron-LM's own ``load_checkpoint`` (the flags carry
``--load DIR --finetune``), forwards every response of rollout step 0 ALONE (no packing, no
planner, no microbatches, no parallelism), and writes ``{"tokens": [[log-probs, entropies] per
rollout]}``: the current policy's per-token terms in float64, from which the test computes every
recorded number with ``tests.support.reference.reference_record`` (plain Python sums written from
the contract). Nothing of the package's loss, aggregation or planning code is used: only the
model infrastructure (the CPU patches, and the core attention that builds an explicit causal
mask) and the synthetic rollout generator (data).
"""
from __future__ import annotations

import json
import os
import sys
from functools import partial


def main() -> None:
    checkout, out_path = sys.argv[1], sys.argv[2]
    net, args = _load_model(checkout, sys.argv[sys.argv.index("--") + 1:])
    from megatron_pg_agg.data.synthetic import synthetic_rollouts

    rollouts = synthetic_rollouts(vocab_size=args.vocab_size, seed=args.seed)[0]
    with open(out_path, "w") as f:
        json.dump({"tokens": _per_token_terms(net, rollouts)}, f)


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


def _per_token_terms(net, rollouts) -> list:
    """Per response: ``[log-probs, entropies]`` of its response tokens, in float64 from one
    unpacked forward pass of the response (over the padded vocabulary, as the model's logits)."""
    import torch

    tokens = []
    with torch.no_grad():
        for r in rollouts:
            ids = list(r.prompt_ids) + list(r.response_ids)
            logits = net(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None], attention_mask=None)
            rows = torch.log_softmax(logits[0].double(), dim=-1)[len(r.prompt_ids) - 1:len(ids) - 1]
            logp = rows.gather(1, torch.tensor(r.response_ids)[:, None])[:, 0]
            tokens.append([logp.tolist(), (-(rows.exp() * rows).sum(-1)).tolist()])
    return tokens


if __name__ == "__main__":
    main()

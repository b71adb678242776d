"""Independent single-process reference for one iteration of the trainer (launch/train_actor.py).

    python -m tests.distributed.workers.trainer_reference CHECKPOINT.pt STEP OUT.json -- <the run's trainer flags>

Builds the trainer's model from its flags (one process, no parallelism), loads the weights of a
checkpoint the run saved (rank 0's file), forwards every response of rollout step STEP of the
built-in set ALONE (no packing, planner, microbatches or DDP), computes the step objective with
``megatron_pg_agg.parity.step_objective`` (float64 per-token Python sums written from the README,
sharing no code with the package's loss or aggregation) and differentiates it. Writes
``{"objective": J, "weight": W, "grad_norm": ||dJ/dtheta||}``: what the run's next iteration must
log (its grad_norm is the norm before clipping).
"""
from __future__ import annotations

import json
import sys


def main() -> None:
    ckpt_path, step, out_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    flags = sys.argv[sys.argv.index("--") + 1:]
    import torch

    from megatron_pg_agg.patches import apply_megatron_patches

    apply_megatron_patches(cpu_gloo=True)
    from megatron_pg_agg.data.synthetic import synthetic_rollouts
    from megatron_pg_agg.megatron.layout import ParallelSizes
    from megatron_pg_agg.megatron.model import build_model_chunks, transformer_config
    from megatron_pg_agg.megatron.parallel import init_distributed, init_parallel
    from megatron_pg_agg.parity import step_objective
    from megatron_pg_agg.training.args import config_from_args
    from megatron_pg_agg.training.run_config import build_parser

    args = build_parser().parse_args(flags)
    if args.rollouts or args.num_experts or args.tensor_model_parallel_size != 1:
        raise SystemExit("the reference covers the built-in rollouts and a dense model")
    init_distributed()
    init_parallel(ParallelSizes(), seed=args.seed)
    config = transformer_config(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        num_attention_heads=args.num_attention_heads, use_cpu_initialization=True,
        calculate_per_token_loss=True)
    model = build_model_chunks(config, args.vocab_size, args.max_position_embeddings,
                               share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)[0]
    state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"][0])
    rollouts = synthetic_rollouts(vocab_size=args.vocab_size, seed=args.seed)[step]

    def forward_logits(ids):
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], None)[0]

    objective, weight = step_objective(forward_logits, rollouts, config_from_args(args))
    objective.backward()
    grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
    grad_norm = float(torch.sqrt(sum((g * g).sum() for g in grads)))
    with open(out_path, "w") as f:
        json.dump({"objective": float(objective), "weight": weight, "grad_norm": grad_norm,
                   "iteration": state["iteration"]}, f)


if __name__ == "__main__":
    main()

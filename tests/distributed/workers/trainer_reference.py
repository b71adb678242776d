"""Independent single-process reference for one iteration of the trainer (launch/train_actor.py).

    python -m tests.distributed.workers.trainer_reference SPEC.json OUT.json

SPEC.json: ``{"checkpoint": PATH or null, "weights": [PATH, ...] (optional), "step": K, "flags":
[the runs' trainer flags], "variants": {name: [more flags]}}``. Builds the trainer's model from the
flags (one process, no parallelism) with the weights of ``checkpoint`` (rank 0's file of a run's
``--save``), or, for null, the seeded initial weights rebuilt as the trainer builds them (seed, then
the same construction; a run's first iteration starts from them). Then, with no packing, planner,
microbatches or DDP, every response of rollout step K of the built-in set is forwarded ALONE:

- ``tokens``: per rollout, the current policy's ``[log-probs, entropies]`` of its response tokens
  in float64 (the inputs of ``tests.support.reference.reference_record``);
- ``variants``: per variant, ``{"objective": J, "weight": W, "grad_norm": ||dJ/dtheta||}`` from
  ``megatron_pg_agg.parity.step_objective`` (float64 per-token Python sums written from the
  README, sharing no code with the package's loss or aggregation) and autograd: what the run's
  next iteration must log (its grad_norm is the norm before clipping).

Writes ``{"iteration": the checkpoint's (0 for the initial weights), "tokens": ..., "variants": ...}``.
``"weights"``: files of ``{single-device name: tensor}`` (trainer_runs.py's, one per rank of a layout)
loaded instead of the seeded initial weights (a PP or TP layout builds other initial weights).
``"partitions": {name: [flags, [[rollout indices of one microbatch], ...]]}`` adds variants whose
objective is the mean over those microbatches of each one's own objective (a per-microbatch mean).
With ``"grads_file": PATH`` in the spec it also saves ``{variant: {name: float64 gradient}}`` there
(torch.save; the single-device names). SPEC.json may be a list of such specs (one process, one
model build each): OUT.json is then the list of their results.
"""
from __future__ import annotations

import json
import sys


def main() -> None:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        specs = json.load(f)
    results = [_one(spec, first=i == 0) for i, spec in enumerate(specs if isinstance(specs, list) else [specs])]
    with open(out_path, "w") as f:
        json.dump(results if isinstance(specs, list) else results[0], f)


def _one(spec: dict, first: bool) -> dict:
    import torch

    from megatron_pg_agg.patches import apply_megatron_patches

    apply_megatron_patches(cpu_gloo=True)
    from megatron_pg_agg.data.synthetic import synthetic_rollouts
    from megatron_pg_agg.megatron.layout import ParallelSizes
    from megatron_pg_agg.megatron.model import build_model_chunks, transformer_config
    from megatron_pg_agg.megatron.parallel import init_distributed, init_parallel, teardown_parallel
    from megatron_pg_agg.parity import step_objective
    from megatron_pg_agg.training.args import config_from_args
    from megatron_pg_agg.training.run_config import build_parser

    parser = build_parser()
    args = parser.parse_args(spec["flags"])
    if args.rollouts or args.num_experts or args.tensor_model_parallel_size != 1:
        raise SystemExit("the reference covers the built-in rollouts and a dense model")
    if first:
        init_distributed()
    init_parallel(ParallelSizes(), seed=args.seed)
    config = transformer_config(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        num_attention_heads=args.num_attention_heads, use_cpu_initialization=True,
        calculate_per_token_loss=True)
    torch.manual_seed(args.seed)  # as the trainer seeds right before it builds
    model = build_model_chunks(config, args.vocab_size, args.max_position_embeddings,
                               share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)[0]
    iteration = 0
    if spec.get("weights"):  # a layout's initial weights by single-device name, merged over its ranks
        merged = {}
        for path in spec["weights"]:
            merged.update(torch.load(path))
        own = dict(model.named_parameters())
        missing = set(own) - set(merged)
        if missing:
            raise SystemExit(f"the weights files lack {sorted(missing)}")
        with torch.no_grad():
            for name, param in own.items():
                param.copy_(merged[name].to(param.dtype))
    if spec["checkpoint"]:
        state = torch.load(spec["checkpoint"], map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"][0])
        iteration = state["iteration"]
    rollouts = synthetic_rollouts(vocab_size=args.vocab_size, seed=args.seed)[spec["step"]]

    def forward_logits(ids):
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], None)[0]

    tokens = []
    with torch.no_grad():
        for r in rollouts:
            rows = torch.log_softmax(forward_logits(list(r.prompt_ids) + list(r.response_ids)).double(), dim=-1)
            scored = rows[len(r.prompt_ids) - 1:len(r.prompt_ids) - 1 + len(r.response_ids)]
            logp = scored.gather(1, torch.tensor(r.response_ids)[:, None])[:, 0]
            entropy = -(scored.exp() * scored).sum(-1)
            tokens.append([logp.tolist(), entropy.tolist()])
    variants, whole = {}, {}
    for name, extra in spec.get("variants", {"": []}).items():
        model.zero_grad(set_to_none=True)
        objective, weight = step_objective(forward_logits, rollouts,
                                           config_from_args(parser.parse_args([*spec["flags"], *extra])))
        objective.backward()
        grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
        variants[name] = {"objective": float(objective), "weight": weight,
                          "grad_norm": float(torch.sqrt(sum((g * g).sum() for g in grads)))}
        whole[name] = {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}
    # the bug class the project exists for: Megatron's default averaging of a per-microbatch
    # sequence mean, J = mean over (rank, microbatch) of that microbatch's own step objective
    for name, (extra, parts) in spec.get("partitions", {}).items():
        model.zero_grad(set_to_none=True)
        cfg = config_from_args(parser.parse_args([*spec["flags"], *extra]))
        objective = sum(step_objective(forward_logits, [rollouts[i] for i in part], cfg)[0]
                        for part in parts) / len(parts)
        objective.backward()
        variants[name] = {"objective": float(objective), "weight": None, "grad_norm": None}
        whole[name] = {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}
    if spec.get("grads_file"):
        torch.save(whole, spec["grads_file"])
    teardown_parallel()
    return {"iteration": iteration, "tokens": tokens, "variants": variants}


if __name__ == "__main__":
    main()

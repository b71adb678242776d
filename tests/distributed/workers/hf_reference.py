"""Float64 reference of an ``--hf-model`` run's first iteration, computed with transformers.

    python -m tests.distributed.workers.hf_reference SPEC.json OUT.json

SPEC.json: ``{"models": {family: HF folder}, "rollouts": JSONL, "variants": {name: [--pg-* flags]}}``.
For each family the folder is loaded by transformers' ``AutoModelForCausalLM`` in float64 (no
Megatron-Bridge, no megatron-core model); the rollout file is read here with ``json`` (not the
package's loader) and its first step (the smallest ``step``, the one iteration 1 trains) is
taken. Every response is forwarded alone; ``megatron_pg_agg.parity.step_objective`` (float64
Python sums from the README's formulas, sharing no code with the package's loss or aggregation)
gives J and W, autograd the gradient. Writes ``{family: {variant: {"objective", "weight",
"grad_norm"}}}``: what the run's first record must say (grad_norm before clipping).
"""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

FIELDS = ("group_id", "prompt_ids", "response_ids", "loss_mask", "advantages", "old_logprobs",
          "numerator_mask", "ref_logprobs")


def first_step(path: str) -> list:
    records = [json.loads(line) for line in open(path) if line.strip()]
    first = min(r["step"] for r in records)
    return [SimpleNamespace(**{name: r.get(name) for name in FIELDS}, main_loss_backward_scale=None,
                            multi_token_prediction=None) for r in records if r["step"] == first]


def main() -> None:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_pg_agg.parity import step_objective
    from megatron_pg_agg.training.args import config_from_args
    from megatron_pg_agg.training.run_config import build_parser

    torch.set_num_threads(1)
    rollouts = first_step(spec["rollouts"])
    parser = build_parser()
    out = {}
    for family, path in spec["models"].items():
        # the eager experts loop: transformers' grouped_mm has no float64 kernel (MoE families)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, experts_implementation="eager")

        def forward_logits(ids, model=model):
            return model(torch.tensor([ids])).logits[0]

        out[family] = {}
        for name, flags in spec["variants"].items():
            model.zero_grad(set_to_none=True)
            objective, weight = step_objective(forward_logits, rollouts, config_from_args(parser.parse_args(flags)))
            objective.backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            out[family][name] = {"objective": float(objective), "weight": weight,
                                 "grad_norm": float(torch.sqrt(sum((g * g).sum() for g in grads)))}
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()

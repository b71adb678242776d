"""The float64 reference of tests/distributed/workers/nemo_rl_checks.py's cases (one process).

    MEGATRON_PG_AGG_NEMO_RL=/path/to/NeMo-RL python -m tests.distributed.workers.nemo_rl_reference OUT_DIR

For every recorded case (``OUT_DIR/<layout>__<case>.pt``) and optimizer step: the same GPTModel in
float64 (``.double()``) at the weights NeMo-RL's step was computed at, every row of the step forwarded
on its own (unpacked, no context parallelism), its next-token log-probs, the objective written from
the formulas (tests/support/nemo_rl_reference.py: NeMo-RL's PPO, KL and importance weight, the mode's
``(1/W) sum c_t pg_t``; NeMo-RL's stock token and sequence level are the project's token_mean and
seq_mean on a batch without an empty response) and its gradient by autograd. Writes
``OUT_DIR/reference.json``: per case and step the engine's objective, the reference, the objective
error of max(|J|, 0.01) and the whole gradient's relative error. The MoE aux-only cases are compared
with each other by the test, not here (their objective has no PG term).
"""
from __future__ import annotations

import glob
import json
import os
import sys

import torch

from tests.support.nemo_rl_reference import DEFAULTS, Options, reference_step

from .nemo_rl_checks import MODES, build

STOCK_MODE = {False: "seq_mean", True: "token_mean"}
"""NeMo-RL's stock loss as one of the project's modes: its token level, its sequence level."""


def _logprobs(model, batch: dict) -> torch.Tensor:
    """float64 ``[B, T-1]``: each row forwarded alone, the log-prob of its next tokens (NeMo-RL's
    ``next_token_logprobs`` layout; 0 past the row's length)."""
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    rows = []
    for i in range(ids.shape[0]):
        n = int(lengths[i])
        logits = model(ids[i:i + 1, :n], torch.arange(n)[None], None)[0]
        lp = torch.log_softmax(logits, -1)[:-1].gather(1, ids[i, 1:n, None])[:, 0]
        rows.append(torch.cat([lp, lp.new_zeros(ids.shape[1] - n)]))
    return torch.stack(rows)


def check(path: str, model) -> dict:
    case = torch.load(path, weights_only=False)
    batch = {k: v.double() if v.is_floating_point() else v for k, v in case["batch"].items()}
    batch["group_of_row"] = case["groups"]
    keys = {**DEFAULTS, **case["keys"]}
    mode = case["mode"] or STOCK_MODE[keys["token_level_loss"]]
    gbs = len(case["groups"]) // len(case["steps"])
    out = []
    for b, step in enumerate(case["steps"]):
        model.load_state_dict({n: w.double() for n, w in step["weights"].items()}, strict=False)
        model.zero_grad(set_to_none=True)
        lp = _logprobs(model, batch)
        reference = reference_step(lp, batch, list(range(b * gbs, (b + 1) * gbs)), Options(case["name"], keys),
                                   mode=mode, divisor=MODES.get(mode))
        reference.backward()
        names = [n for n, _ in model.named_parameters()]
        ref_grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              for _, p in model.named_parameters()])
        got_grad = torch.cat([step["grad"][n].double().reshape(-1) for n in names])
        objective = case["objectives"][b]
        out.append({"objective": objective, "reference": float(reference),
                    "objective_error": abs(objective - float(reference)) / max(abs(float(reference)), 0.01),
                    "grad_error": float((got_grad - ref_grad).norm() / ref_grad.norm()),
                    "grad_norm": float(ref_grad.norm())})
    return {"layout": case["layout"], "name": case["name"], "mode": case["mode"], "kind": case["kind"],
            "path": case["path"], "steps": out}


def main(argv: list) -> None:
    out_dir = argv[0]
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 500))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    from megatron_pg_agg.integrations.nemo_rl.cpu import apply_nemo_rl_cpu_patches

    apply_nemo_rl_cpu_patches()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model = build(1, "fixed", False)[0].module.double()
    results = [check(path, model) for path in sorted(glob.glob(os.path.join(out_dir, "*__*.pt")))
               if "__moe-" not in path]
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(results, f)
    worst = max((s["objective_error"] for r in results for s in r["steps"]), default=0.0)
    print(f"nemo_rl_reference: {len(results)} cases, worst objective error {worst:.2e}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])

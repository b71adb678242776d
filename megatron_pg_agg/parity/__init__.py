"""Layout parity: one optimizer step under several parallel layouts against a single-device reference.

    python -m megatron_pg_agg.parity                      # every layout, mode and policy loss
    python -m megatron_pg_agg.parity --modes seq_mean --policy-losses ppo,gspo --json out.json --plot errors.png

The launcher groups the layouts by world size and starts one ``torchrun`` per group (many layouts
per launch: start-up dominates). Each worker computes the reference on its own (TP = PP = 1,
per-sequence forward passes, the objective in float64 Python sums written from the README's
formulas, sharing no code with the package's loss or aggregation, autograd), then for every
layout: builds the model with the reference weights (TP shards sliced by ``partition_dim``,
pipeline layers mapped by ``layer_number``), plans the step, runs megatron-core's real
forward-backward schedule with DDP and ``finalize_model_grads``, gathers the gradient shards and
compares: the logged objective within 1e-6 relative, every parameter's gradient within 1e-5
(max abs error / max abs reference value). Layouts marked as controls are negative controls:
they pass the check only if parity FAILS. Exit status 0 iff every row passes.

Modules: ``fixture`` (tolerances, the built-in step, the cases), ``models`` (the tiny models),
``reference`` (the independent objective), ``workers`` (the torchrun side), ``report`` (tables,
plot), ``cli`` (the command).
"""
from .cli import launch, main
from .fixture import (
                      CONSTANT_DIVISOR,
                      DEFAULT_CASES,
                      GRAD_RTOL,
                      MODES,
                      OBJECTIVE_RTOL,
                      POLICY_LOSSES,
                      VOCAB,
                      ParityCase,
                      loss_config,
                      parity_rollouts,
)
from .reference import step_objective
from .report import find_markdown_table, markdown_table

__all__ = ["CONSTANT_DIVISOR", "DEFAULT_CASES", "GRAD_RTOL", "MODES", "OBJECTIVE_RTOL", "POLICY_LOSSES", "VOCAB",
           "ParityCase", "find_markdown_table", "launch", "loss_config", "main", "markdown_table",
           "parity_rollouts", "step_objective"]

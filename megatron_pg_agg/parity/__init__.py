"""Layout parity: one optimizer step under several parallel layouts against a single-device reference.

The command and what it checks: :mod:`.cli` (its docstring is the command's ``--help``).

Modules: ``fixture`` (tolerances, the built-in step, the cases), ``models`` (the tiny models),
``reference`` (the independent objective), ``workers`` (the torchrun side), ``report`` (tables,
plot), ``cli`` (the command).
"""
import importlib

_LAZY = {"launch": "cli", "CONSTANT_DIVISOR": "fixture", "DEFAULT_CASES": "fixture", "GRAD_RTOL": "fixture",
         "MODES": "fixture", "OBJECTIVE_RTOL": "fixture", "POLICY_LOSSES": "fixture", "VOCAB": "fixture",
         "ParityCase": "fixture", "loss_config": "fixture", "parity_rollouts": "fixture",
         "step_objective": "reference", "find_markdown_table": "report", "markdown_table": "report"}
"""Names served from their modules on first use: importing the package imports no megatron-core, so
the command can silence megatron-core's known start-up noise first."""

__all__ = ["CONSTANT_DIVISOR", "DEFAULT_CASES", "GRAD_RTOL", "MODES", "OBJECTIVE_RTOL", "POLICY_LOSSES", "VOCAB",
           "ParityCase", "find_markdown_table", "launch", "loss_config", "main", "markdown_table",
           "parity_rollouts", "step_objective"]


def main(argv=None) -> int:
    """``megatron-pg-agg-parity`` / ``python -m megatron_pg_agg.parity`` (:func:`.cli.main`), with
    megatron-core's known start-up noise silenced unless ``--verbose``."""
    from megatron_pg_agg.training.worker_process import quiet_startup_noise, verbose_requested  # noqa: PLC0415

    quiet_startup_noise(verbose=verbose_requested(argv), outside_info=True)
    from .cli import main as cli_main  # noqa: PLC0415

    return cli_main(argv)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

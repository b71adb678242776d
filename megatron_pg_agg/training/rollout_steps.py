"""The one rollout-steps loader of both entries: ``{step: RolloutBatch}``, each step packed and
checked once, before any process group exists."""
from __future__ import annotations

from typing import Optional

from megatron_pg_agg.core.losses import PGLossConfig
from megatron_pg_agg.data.rollout_files import RolloutFormatError, load_rollouts
from megatron_pg_agg.data.rollouts import PlanError, RolloutBatch
from megatron_pg_agg.data.synthetic import synthetic_rollouts

from .run_config import DataConfig, StartupError


def load_steps(data: DataConfig, loss_cfg: PGLossConfig, *, vocab_size: Optional[int], seed: int,
               check_vocabulary: bool = True) -> dict:
    """``{step: RolloutBatch}`` from ``data.rollouts`` (a JSONL file: its format errors, with file,
    line and field, become :class:`StartupError`) or the built-in synthetic set (vocabulary
    ``vocab_size``, seeded by ``seed``). ``loss_cfg``: a KL penalty makes reference log-probs
    mandatory. ``check_vocabulary``: token ids are checked against ``vocab_size`` here (the
    trainer); the Megatron-LM entry checks them against the padded vocabulary when it plans."""
    checked_vocab = vocab_size if check_vocabulary else None
    if data.rollouts is not None:
        try:
            return load_rollouts(data.rollouts, vocab_size=checked_vocab, require_ref=loss_cfg.needs_reference)
        except RolloutFormatError as err:
            raise StartupError(str(err)) from err
    if vocab_size is None:
        raise StartupError("the built-in synthetic rollouts need --vocab-size (or pass a rollout file)")
    steps = {}
    for key, rollouts in synthetic_rollouts(vocab_size=vocab_size, seed=seed).items():
        try:
            steps[key] = RolloutBatch.from_rollouts(rollouts, vocab_size=checked_vocab)
        except PlanError as err:
            raise StartupError(f"step {key}: {err}") from err
    return steps

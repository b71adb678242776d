"""The main job's command line (``launch/train_actor.py``): the trainer's (:mod:`megatron_pg_agg.training.cli`),
with the online job for a run without ``--rollouts``: online GRPO on the built-in reach task through the
trainer itself (:func:`megatron_pg_agg.online.main_job.train_online`). The command line lives here, above
both, so that the trainer's layer imports nothing of the online run."""
from __future__ import annotations

from megatron_pg_agg.training import cli as trainer_cli
from megatron_pg_agg.training.run_config import RunConfig


def _online_job(cfg: RunConfig) -> dict:
    # imported only now: it imports megatron.core, after the trainer's command line quieted its noise
    from megatron_pg_agg.online.main_job import train_online  # noqa: PLC0415

    return train_online(cfg)


def main(argv=None) -> int:
    """``launch/train_actor.py``'s exit status (:func:`megatron_pg_agg.training.cli.main`'s meanings)."""
    return trainer_cli.main(argv, online_job=_online_job)

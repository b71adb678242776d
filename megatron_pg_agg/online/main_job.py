"""The main job online: ``launch/train_actor.py`` without ``--rollouts``.

GRPO on the built-in reach task (:mod:`.reach`) through the trainer itself: the trainer's
:func:`~megatron_pg_agg.training.trainer.setup` (checks, process groups, model, resume), a short
supervised warm-up on the task's demonstrations (:meth:`.grpo.OnlineRun.warm_up`, skipped when
``--load`` resumes a run), then ``--train-iters`` iterations of :meth:`.grpo.OnlineRun.iteration`
(sample from the live policy, score with the verifier, group advantages, ``--updates-per-batch``
trainer steps under the run's ``--pg-*`` loss) in the trainer's own loop
(:func:`~megatron_pg_agg.training.trainer.run_iterations`: the ``[train]`` line and metrics record
of every iteration, checkpoints, the final line).

Everything is seeded by ``--seed``: the weights, the warm-up's demonstrations, each iteration's
prompts (``(seed, iteration)``) and each DP rank's samples; a resumed run samples iteration k as
the run it continues would have.
"""
from __future__ import annotations

import logging
import time

from megatron_pg_agg.data.reach import ReachTask
from megatron_pg_agg.training.run_config import RunConfig
from megatron_pg_agg.training.trainer import run_iterations, setup

from .grpo import OnlineRun

__all__ = ["start_line", "train_online"]

logger = logging.getLogger(__name__)


def start_line(cfg: RunConfig) -> str:
    """What the start line says the online run trains on (in place of the offline ``steps=N``)."""
    online = cfg.online
    return (f"mode={cfg.loss.mode} online GRPO on the reach task: {online.prompts_per_step} prompts x "
            f"{online.group_size} samples per iteration, {online.updates_per_batch} updates each, "
            f"advantages {'(r - mean) / std' if online.advantage_std else 'r - mean'}")


def train_online(cfg: RunConfig) -> dict:
    """The whole online job (module docstring). Returns rank 0's last metrics record."""
    run = OnlineRun(setup(cfg, steps={}, data=start_line(cfg)), ReachTask())  # setup checks cfg first
    online = cfg.online
    seed = cfg.training.seed
    if run.s.state.iteration == 0:
        t0 = time.perf_counter()
        if online.warmup_steps:
            logger.info(f"warm-up: {online.warmup_steps} supervised steps on {online.warmup_batch} of the task's "
                        f"demonstrations each (token_mean, lr {online.warmup_lr:g}); the RL iterations follow")
            run.warm_up(online, seed)
        start = run.evaluate(online, seed)
        logger.info(f"warm-up done in {time.perf_counter() - t0:.0f} s: accuracy {start['accuracy']:.3f}, "
                    f"response length {start['response_length']:.1f} (sampled, "
                    f"{start['responses']} responses); RL: --lr {cfg.training.lr:g}, fresh Adam")
        run.reset(None, cfg.loss, cfg.training.lr)
    return run_iterations(run.s, lambda: run.iteration(online, seed))

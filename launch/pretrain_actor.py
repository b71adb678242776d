"""torchrun entry point: the policy-gradient actor inside Megatron-LM's own ``pretrain()``.

    torchrun --nproc_per_node 2 launch/pretrain_actor.py --megatron-lm PATH \\
        <Megatron-LM flags> --calculate-per-token-loss --pg-loss-aggregation MODE [--pg-rollouts FILE]

``--megatron-lm`` (or ``MEGATRON_LM_PATH``) names a Megatron-LM checkout, core_v0.15.x to
core_v0.19.x, of the installed megatron-core's release. Exit status 2: refused at start-up (every
problem listed). The pieces live in megatron_pg_agg.training.megatron_lm.
"""
import sys

from megatron_pg_agg.training.megatron_lm import main

if __name__ == "__main__":
    sys.exit(main())

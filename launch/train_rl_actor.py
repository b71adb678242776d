"""Policy-gradient actor in Megatron-LM's own RL loop (train_rl.py), with the --pg-* loss flags.

    torchrun --nproc_per_node N launch/train_rl_actor.py --megatron-lm PATH <Megatron-LM RL flags> \
        --calculate-per-token-loss --pg-loss-aggregation seq_mean [--pg-replay-rollouts FILE|builtin]

See docs/megatron-rl.md and megatron_pg_agg/training/megatron_rl.py.
"""
import sys

from megatron_pg_agg.training.megatron_rl import main

if __name__ == "__main__":
    sys.exit(main())

"""torchrun entry point: train a PPO/GRPO actor with megatron-core and megatron_pg_agg.

    torchrun --nproc_per_node 2 launch/train_actor.py                  # online GRPO on the built-in reach task
    torchrun --nproc_per_node 2 launch/train_actor.py --rollouts synthetic   # the tests' fixed synthetic replay
    torchrun --nproc_per_node 8 launch/train_actor.py --rollouts steps.jsonl \\
        --tensor-model-parallel-size 2 --pg-loss-aggregation seq_mean ...

Flags: ``python launch/train_actor.py --help``. The loop lives in megatron_pg_agg.training.trainer.
"""
import sys

from megatron_pg_agg.online.cli import main

if __name__ == "__main__":
    sys.exit(main())

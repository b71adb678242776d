"""torchrun entry point: Megatron-Bridge's own training loop (``megatron.bridge.training.pretrain``)
with the project's policy-gradient objective, on a local HF model and rollout files.

    torchrun --nproc_per_node 2 launch/train_bridge_actor.py --hf-model DIR --rollouts steps.jsonl \\
        --pg-loss-aggregation prompt_mean --num-microbatches 2 --train-iters 10

Python 3.12 with the ``bridge`` extra (docs/hf-models.md). Flags: ``--help``. The pieces live in
megatron_pg_agg.integrations.bridge.loop (for a user's own ConfigContainer recipe) and
megatron_pg_agg.integrations.bridge.cli.
"""
import sys

from megatron_pg_agg.integrations.bridge.cli import main

if __name__ == "__main__":
    sys.exit(main())

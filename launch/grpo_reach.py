"""torchrun entry point: online GRPO on the reach task, every loss aggregation compared.

    torchrun --nproc_per_node 2 launch/grpo_reach.py            # 3 seeds x 5 variants (docs/length-bias.md)
    torchrun --nproc_per_node 2 launch/grpo_reach.py --quick    # 1 seed, GRPO vs Dr. GRPO

Flags: ``python launch/grpo_reach.py --help``. The code lives in megatron_pg_agg.online.
"""
import sys

from megatron_pg_agg.online.comparison_cli import main

if __name__ == "__main__":
    sys.exit(main())

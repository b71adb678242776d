"""NeMo-RL's own GRPO launcher (``examples/run_grpo.py`` of the NeMo-RL checkout) with one change: the
loss object ``setup()`` returns is the plug-in's (``use_pg_agg``), between ``setup()`` and the trainer.

    MEGATRON_PG_AGG_NEMO_RL=/path/to/NeMo-RL uv run python /path/to/megatron_pg_agg/launch/nemo_rl_grpo.py \\
        --config examples/configs/grpo_math_1B_megatron.yaml ++loss_fn.pg_agg.mode=prompt_mean

Arguments and config are NeMo-RL's (``--config`` and Hydra overrides); the objective is
``loss_fn.pg_agg`` (docs/nemo-rl.md). The file run is NeMo-RL's own, unchanged: this script loads
it from the checkout and wraps its ``setup`` for the one change. Needs NeMo-RL's own stack (Ray,
its generation backend, GPUs) and megatron_pg_agg installed where its Megatron workers run.
"""
from megatron_pg_agg.integrations.nemo_rl_launch import main

if __name__ == "__main__":
    main()

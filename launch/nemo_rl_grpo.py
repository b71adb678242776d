"""NeMo-RL's own GRPO launcher (``examples/run_grpo.py`` of the NeMo-RL checkout) with two changes: the
plug-in's config checks run as soon as the config is loaded (before Ray, the tokenizer, the data and
``setup()``), and the loss object ``setup()`` returns is the plug-in's (``use_pg_agg``), between
``setup()`` and the trainer. From the NeMo-RL checkout, its Megatron policy on:

    MEGATRON_PG_AGG_NEMO_RL=$PWD uv run python /path/to/megatron_pg_agg/launch/nemo_rl_grpo.py \\
        --config examples/configs/grpo_math_1B.yaml policy.megatron_cfg.enabled=true \\
        policy.dtensor_cfg.enabled=false ++loss_fn.pg_agg.mode=prompt_mean

Arguments and config are NeMo-RL's (``--config`` and Hydra overrides); the objective is
``loss_fn.pg_agg`` (docs/nemo-rl.md). The file run is NeMo-RL's own, unchanged: this script loads
it from the checkout and wraps its ``MasterConfig`` and ``setup`` for the two changes
(:mod:`megatron_pg_agg.integrations.nemo_rl.launch`). Needs NeMo-RL's own stack (Ray,
its generation backend, GPUs) and megatron_pg_agg installed where its Megatron workers run.
"""
from megatron_pg_agg.integrations.nemo_rl.launch import main

if __name__ == "__main__":
    main()

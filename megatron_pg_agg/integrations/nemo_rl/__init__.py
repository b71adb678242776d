"""NeMo-RL's GRPO on its Megatron policy with the project's objective (docs/nemo-rl.md).

``plugin`` (the ``loss_fn.pg_agg`` config, its refusals, ``use_pg_agg``), ``weights`` and ``loss`` (the
driver's fields and the loss object), ``launch`` (``launch/nemo_rl_grpo.py``: NeMo-RL's own
``examples/run_grpo.py`` with the checks first), ``cpu`` (NeMo-RL's Megatron training path on a CPU
machine, tests).
"""

"""verl 0.9's Megatron engine on the project's objective (docs/verl.md).

``plugin`` is the module verl loads (its ``verl.plugins`` entry point, or
``VERL_USE_EXTERNAL_MODULES=megatron_pg_agg.integrations.verl.plugin``); it applies ``engine_patch``.
``config`` reads verl's keys (no verl import), ``loss`` the per-micro-batch losses, ``worker_losses``
the losses verl's workers train with.
"""

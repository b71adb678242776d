"""AReaL 1.0.x's Megatron actor and critic on the project's objective (docs/areal.md).

``plugin`` is what a training script imports (``use_pg_agg``, the actor and critic classes); ``loss``
computes the step weights before AReaL's splits; ``actor_patch`` patches AReaL's own code (applied by
the plug-in); ``cpu`` runs AReaL's Megatron engine on a CPU machine (tests).
"""

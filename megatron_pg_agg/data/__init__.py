"""Rollouts on the host: the rollout record and its checks, rollout files, the built-in synthetic
set, the built-in verifiable task of the online run (``reach``: prompts, verifier, demonstrations),
and the planner that turns one optimizer step's rollouts into packed THD microbatches with their
step weights and rollout corrections. Imports nothing of megatron."""

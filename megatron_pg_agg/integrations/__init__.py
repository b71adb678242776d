"""Integrations with the frameworks users already run, beside :mod:`megatron_pg_agg.training`.

Each calls the same planner, step runner and loss as the trainer; none is imported by the package
itself, so ``import megatron_pg_agg`` works without the framework installed.

``hf_folder`` (:mod:`.hf_folder`)
    Host checks of a local Hugging Face causal-LM folder (config, weights, tokenizer files) and of
    the install Megatron-Bridge needs; no torch, megatron-core or Megatron-Bridge import.
``hf_bridge`` (:mod:`.hf_bridge`)
    Hugging Face checkpoints in and out through Megatron-Bridge: the model shape of a folder, its
    megatron-core model chunks with the weights loaded, the live model's HF weights as
    ``(name, tensor)`` pairs, and an atomically written HF folder.
``verl_config``, ``verl_loss``, ``verl_plugin`` (:mod:`.verl_plugin`)
    The verl plug-in (docs/verl.md): verl's actor keys and the ``pg_agg`` block to a
    :class:`~megatron_pg_agg.core.losses.PGLossConfig` (no verl import); the step weights of a
    verl mini-batch and the per-micro-batch loss in verl's engine; the entry point verl loads.
"""

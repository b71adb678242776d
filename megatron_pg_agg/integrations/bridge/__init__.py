"""Megatron-Bridge and Hugging Face models (docs/hf-models.md).

``hf_folder`` (host checks, no torch import) and ``hf_model`` (HF checkpoints in and out of megatron-core:
the trainer reaches it through the ``megatron_pg_agg.model_sources`` entry point, never by import);
``loop`` and ``cli`` (Megatron-Bridge's own training loop, ``launch/train_bridge_actor.py``); ``tiny_hf``
(tiny local models); ``cpu`` (Megatron-Bridge on a CPU machine).
"""

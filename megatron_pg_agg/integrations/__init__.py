"""Integrations with the frameworks users already run, beside :mod:`megatron_pg_agg.training`: one folder per host.

Each calls the same planner, step runner and loss as the trainer; none is imported by the package
itself, so ``import megatron_pg_agg`` works without the framework installed. A host's folder holds
everything that host's users run: the plug-in, its translation into the host's normaliser, its patches
of the host's own code (``*_patch.py``), and in ``cpu/`` the stand-ins that only make the host run on a
CPU machine (each refuses to apply where CUDA is available). Each folder applies its own patches
through the machinery (:mod:`megatron_pg_agg.patches._machinery`); ``patches/`` holds Megatron's.

``areal/`` (docs/areal.md)
    ``plugin`` (``use_pg_agg``, the actor and critic classes), ``loss`` (step weights before AReaL's
    splits, AReaL's own loss), ``actor_patch`` (the optimizer steps along whole prompt groups, the
    critic's value head before DDP), ``cpu/`` (AReaL's Megatron engine and mbridge on CPU:
    ``apply_areal_cpu_patches``).
``verl/`` (docs/verl.md)
    ``plugin`` (the entry point verl loads), ``config`` (verl's keys and the ``pg_agg`` block, the
    critic's mode), ``loss`` (step weights on verl's mini-batch, the actor's and critic's losses),
    ``worker_losses`` (the losses verl's workers train with), ``engine_patch`` (the engine and worker
    seams).
``slime/`` (docs/slime.md)
    ``plugin`` (slime's conversion hook and its checks), ``weights`` (slime's names for the shared
    per-sample denominators).
``miles/`` (docs/miles.md)
    ``plugin`` (miles' conversion hook, its step grouping and its checks).
``slime_family/``
    what the slime and miles plug-ins share: ``weights`` (the per-sample denominators
    ``W / (R c_i)``), ``hook`` (the config block, the common refusals, the denominators written).
``nemo_rl/`` (docs/nemo-rl.md)
    ``plugin`` (config, refusals, ``use_pg_agg``, the ``Policy.train`` wrapper), ``weights`` (the
    driver's fields), ``loss`` (the loss object), ``launch`` (``launch/nemo_rl_grpo.py``), ``cpu/``
    (NeMo-RL's Megatron training path on CPU: ``apply_nemo_rl_cpu_patches``).
``bridge/`` (Megatron-Bridge and Hugging Face models, docs/hf-models.md)
    ``hf_folder`` (host checks of an HF folder and the install; no torch import), ``hf_model`` (HF
    checkpoints in and out: the trainer's ``--hf-model``/``--save-hf`` through its entry point),
    ``loop`` (Megatron-Bridge's own training loop), ``cli`` (``launch/train_bridge_actor.py``),
    ``tiny_hf`` (tiny local models), ``cpu/`` (Megatron-Bridge on CPU: ``apply_bridge_cpu_patches``).

Shared by the hosts: :mod:`.step_weights` (the step weights over every DP rank) and :mod:`.objective`
(the objective a host's config names, validated once).
"""

"""The two entries and what they share: the ``--pg-*`` flags, the trainer's run config, loop,
checkpoints, metrics and command line, the Megatron-LM ``pretrain()`` entry, and worker-process
hygiene (dying with the launcher, start-up noise)."""

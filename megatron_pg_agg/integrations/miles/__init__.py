"""miles' Megatron loss on the project's objective (docs/miles.md).

``plugin`` holds the function miles' ``--custom-convert-samples-to-train-data-path`` names
(``megatron_pg_agg.integrations.miles.plugin.convert_samples_to_train_data``), its step grouping and
its checks; the denominators and the hook's common part are slime's (``integrations/slime_family``).
"""

"""slime's Megatron loss on the project's objective (docs/slime.md).

``plugin`` holds the function slime's ``--custom-convert-samples-to-train-data-path`` names
(``megatron_pg_agg.integrations.slime.plugin.convert_samples_to_train_data``) and its checks;
``weights`` the per-sample denominators (no slime import).
"""

"""megatron_pg_agg."""

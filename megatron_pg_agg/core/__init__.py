"""The aggregation maths: modes, per-token weights, segments, the policy losses and the rollout-engine correction.

Imports torch and nothing of megatron: every formula here can be read, tested and reused without
megatron-core installed. The contract (the formula of every mode) is in
:mod:`megatron_pg_agg.core.aggregation`.
"""

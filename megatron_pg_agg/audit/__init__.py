"""The audit: what a host's own config makes its stock loss optimise, how much it moves with the split,
and the one line that makes it exact (docs/audit.md; the command: :mod:`megatron_pg_agg.audit.cli`).

The layer on top: it imports the integrations (the plug-ins' objectives and step weights) and the
hosts' own code, never the other way round.
"""
from megatron_pg_agg.audit.cli import main

__all__ = ["main"]

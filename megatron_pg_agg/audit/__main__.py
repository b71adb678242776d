"""``python -m megatron_pg_agg.audit HOST ...``: see :mod:`megatron_pg_agg.audit.cli`."""
import sys

from megatron_pg_agg.audit.cli import main

if __name__ == "__main__":
    sys.exit(main())

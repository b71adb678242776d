"""``python -m tests.unit.audit.slime_stand_ins AUDIT-ARGS``: the audit command with the slime CPU workers'
stand-ins installed first (tests/distributed/workers/slime_family_cpu.py: inert modules for what slime
imports and the audit's path never calls, sglang's parser among them; ``ray`` with ``remote``) and
megatron-core on CPU (the project's ``cpu_gloo`` and ``megatron_lm_cpu`` patches, as those workers). A user
runs the audit in slime's own environment, where those packages are installed."""
import os
import sys

from tests.distributed.workers.slime_family_cpu import install_stand_ins

if __name__ == "__main__":
    install_stand_ins()
    from megatron_pg_agg.patches import apply_megatron_patches
    from megatron_pg_agg.training.megatron_lm import use_checkout

    use_checkout(os.path.abspath(os.environ["MEGATRON_LM_PATH"]))  # the patches check the checkout's release

    apply_megatron_patches(cpu_gloo=True, megatron_lm_cpu=True)
    from megatron_pg_agg.audit.cli import main

    sys.exit(main())

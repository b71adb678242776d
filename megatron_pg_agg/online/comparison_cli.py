"""The torchrun entry of the length-bias comparison (``launch/grpo_reach.py``): megatron-core's known
start-up noise is quieted, the flags of :mod:`.comparison` parsed, and only then is :mod:`.run` (which
imports megatron-core) loaded. Kept apart from both so that neither imports the other back."""
from __future__ import annotations

from megatron_pg_agg.online.comparison import BY_NAME, QUICK, build_parser


def main(argv=None) -> int:
    """The torchrun entry (``launch/grpo_reach.py``)."""
    from megatron_pg_agg.training.logs import setup_logging  # noqa: PLC0415
    from megatron_pg_agg.training.worker_process import quiet_startup_noise  # noqa: PLC0415

    setup_logging("[reach]")
    quiet_startup_noise(verbose="--verbose" in (argv or []), outside_info=True)
    args, extra = build_parser().parse_known_args(argv)
    if args.quick:
        args.seeds, args.steps, args.variants = QUICK["seeds"], QUICK["steps"], ",".join(QUICK["variants"])
    unknown = [n for n in args.variants.split(",") if n not in BY_NAME]
    if unknown:
        build_parser().error(f"--variants: unknown {unknown}; choose from {', '.join(BY_NAME)}")
    variants = [BY_NAME[n] for n in args.variants.split(",")]
    from megatron_pg_agg.online.run import run_comparison  # noqa: PLC0415  (imports megatron.core after the quieting)

    return run_comparison(args, variants, extra)

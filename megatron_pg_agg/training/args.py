"""Command-line flags for Megatron-LM runs: ``add_pg_agg_args`` is an ``extra_args_provider``.

    from megatron.training import pretrain
    from megatron_pg_agg import add_pg_agg_args, config_from_args
    pretrain(..., extra_args_provider=add_pg_agg_args)
    cfg = config_from_args(get_args())

The flags join the parser as one argument group. Nothing else in the parser is touched (no
default of an existing flag changes); a flag that already exists is refused with a clear error
instead of being shadowed. Combinations are checked when the parser parses (a divisor without
``constant``, ``constant`` without a divisor, ...): the error comes out as argparse's usual
usage error, before any process group or model exists.
"""
from __future__ import annotations

import argparse
import functools

from megatron_pg_agg.core.losses import KL_ESTIMATORS, POLICY_LOSSES, ROLLOUT_CORRECTIONS, PGLossConfig
from megatron_pg_agg.core.modes import ALIASES, REFUSED_ALIASES, mode_choices

#: (flag, argparse kwargs). Defaults match PGLossConfig's.
PG_FLAGS = (
    ("--pg-loss-aggregation", dict(
        default="token_mean", choices=mode_choices(), metavar="MODE",
        help="unit of averaging of the policy-gradient loss: token_mean (default), seq_mean, "
             "prompt_mean, constant (needs --pg-loss-aggregation-divisor); peers' names "
             "(verl, TRL) are accepted: " + ", ".join(ALIASES) + "; refused with the reason: "
             + ", ".join(REFUSED_ALIASES))),
    ("--pg-loss-aggregation-divisor", dict(
        type=float, default=None, metavar="L",
        help="L of the constant mode (e.g. the maximum response length): "
             "J = sum of token losses / (active sequences * L)")),
    ("--pg-clip-eps", dict(type=float, default=0.2,
                           help="PPO clip epsilon (lower; also upper unless --pg-clip-eps-high)")),
    ("--pg-clip-eps-high", dict(type=float, default=None,
                                help="PPO upper clip epsilon (DAPO clip-higher; default: --pg-clip-eps)")),
    ("--pg-dual-clip", dict(type=float, default=None, metavar="C",
                            help="dual-clip constant C > 1 for negative advantages (default: off)")),
    ("--pg-kl-coef", dict(type=float, default=0.0, help="KL penalty weight against the reference policy (token mean)")),
    ("--pg-kl-estimator", dict(default="k3", choices=KL_ESTIMATORS, help="per-token KL estimator")),
    ("--pg-entropy-coef", dict(type=float, default=0.0, help="entropy bonus weight (token mean)")),
    ("--pg-policy-loss", dict(
        default="ppo", choices=POLICY_LOSSES,
        help="per-token policy loss: ppo (clipped surrogate), gspo (sequence ratio; exact GSPO under "
             "seq_mean), gmpo (geometric mean of token ratios), cispo (clipped IS weight on log p)")),
    ("--pg-rollout-correction", dict(
        default=None, choices=ROLLOUT_CORRECTIONS,
        help="rollout-engine correction from the rollouts' rollout_logprobs: token_truncate (TIS), "
             "token_mask, sequence_truncate, sequence_mask (PG term only; default: off)")),
    ("--pg-rollout-correction-max", dict(type=float, default=2.0, metavar="C",
                                         help="cap of the correction weight; upper bound of the masks")),
    ("--pg-rollout-correction-min", dict(type=float, default=0.0, metavar="c",
                                         help="lower bound of the masks")),
    ("--pg-skip-nonfinite-steps", dict(
        action="store_true",
        help="skip (and count) a step whose loss or gradient is not finite instead of stopping")),
)


PLAN_AHEAD_FLAG = ("--pg-plan-ahead", dict(
    action=argparse.BooleanOptionalAction, default=True,
    help="plan optimizer step k+1 on a background host thread while step k runs (default; identical "
         "plans, a bad step's error raised at that step); --no-pg-plan-ahead: plan each step when it "
         "starts"))
"""The plan-ahead switch of the entries that plan the steps themselves (the trainer, Megatron-LM's
``pretrain()`` and RL entries; :mod:`megatron_pg_agg.data.plan_ahead`). Not one of
:data:`PG_FLAGS`: a user's own ``pretrain()`` with :func:`add_pg_agg_args` plans nothing of ours."""


def add_plan_ahead_arg(group) -> None:
    """Add ``--pg-plan-ahead`` / ``--no-pg-plan-ahead`` (dest ``pg_plan_ahead``, default True) to an
    argument parser or group."""
    flag, kwargs = PLAN_AHEAD_FLAG
    group.add_argument(flag, **kwargs)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def config_from_args(args: argparse.Namespace) -> PGLossConfig:
    """The typed loss config from parsed flags (raises ValueError on a bad combination)."""
    return PGLossConfig(
        mode=args.pg_loss_aggregation,
        divisor=args.pg_loss_aggregation_divisor,
        clip_eps_low=args.pg_clip_eps,
        clip_eps_high=args.pg_clip_eps_high,
        dual_clip=args.pg_dual_clip,
        kl_coef=args.pg_kl_coef,
        kl_estimator=args.pg_kl_estimator,
        entropy_coef=args.pg_entropy_coef,
        policy_loss=args.pg_policy_loss,
        rollout_correction=args.pg_rollout_correction,
        rollout_correction_max=args.pg_rollout_correction_max,
        rollout_correction_min=args.pg_rollout_correction_min,
    )


def _validated(parse_known_args, parser):
    @functools.wraps(parse_known_args)
    def parse_known_args_and_validate(*a, **kw):
        namespace, extras = parse_known_args(*a, **kw)
        if hasattr(namespace, "pg_loss_aggregation"):
            try:
                # the flags are checked where the config is built: PGLossConfig.__post_init__. The
                # object is not kept on the namespace: under Megatron-LM that namespace is its
                # global args, which its checkpoints pickle
                config_from_args(namespace)
            except (TypeError, ValueError) as err:
                flagged = (str(err).replace("divisor=", "--pg-loss-aggregation-divisor=")
                           .replace("mode=", "--pg-loss-aggregation="))
                parser.error(flagged)
        return namespace, extras

    parse_known_args_and_validate._megatron_pg_agg_validating = True
    return parse_known_args_and_validate


def add_pg_agg_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the policy-gradient flags to ``parser`` (Megatron-LM ``extra_args_provider``).

    Refuses (ValueError) a parser that already defines one of the flags or destinations.
    Parsing then also validates combinations (see the module docstring). Returns the parser.
    """
    existing = set(parser._option_string_actions)
    dests = {action.dest for action in parser._actions}
    clashes = [f for f, _ in PG_FLAGS if f in existing or _dest(f) in dests]
    if clashes:
        raise ValueError(
            f"add_pg_agg_args: the parser already defines {clashes}; megatron_pg_agg will not "
            "shadow an existing flag. Remove the duplicate or rename it."
        )
    group = parser.add_argument_group("policy-gradient loss (megatron_pg_agg)")
    for flag, kwargs in PG_FLAGS:
        group.add_argument(flag, **kwargs)
    if not getattr(parser.parse_known_args, "_megatron_pg_agg_validating", False):
        # instance attribute: parse_args() goes through parse_known_args(), so both validate
        parser.parse_known_args = _validated(parser.parse_known_args, parser)
    return parser


def flag_value(argv: list, flag: str):
    """The last value given to ``flag`` (``--flag V`` or ``--flag=V``) on a raw command line; None if
    absent (the Megatron-LM entries' checks before Megatron-LM parses, and the audit's)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value

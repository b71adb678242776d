"""One module per host: its config through its own loader, its stock loss and split through its own code.

Each module has ``INSTALL`` (the one line that installs the host), ``load(config, overrides, argv,
options) -> HostConfig`` (raises :class:`HostMissing` when the host is not importable, and lets the
host's own refusal of a key it does not know through), and ``stock`` / ``plugin``, both
``(config, batch, split, leaves) -> (J, steps)`` as :mod:`megatron_pg_agg.audit.measure` calls them.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from megatron_pg_agg.audit.batch import BatchShape
from megatron_pg_agg.training.args import flag_value  # noqa: F401 (the hosts take it from here)

__all__ = ["HOSTS", "HostConfig", "HostMissing", "HostRefusal", "command_line", "flag_value", "without_flags"]

HOSTS = {"megatron-lm": "megatron_pg_agg.audit.hosts.megatron_lm", "slime": "megatron_pg_agg.audit.hosts.slime",
         "verl": "megatron_pg_agg.audit.hosts.verl", "areal": "megatron_pg_agg.audit.hosts.areal",
         "nemo-rl": "megatron_pg_agg.audit.hosts.nemo_rl"}
"""The command's HOST names and the module that audits each."""


class HostMissing(RuntimeError):
    """The host (or its checkout) is not there: the message is one line naming how to install it."""


class HostRefusal(RuntimeError):
    """The host's own loader refuses the config: the message is the host's, on one line."""


@dataclass(frozen=True)
class HostConfig:
    """A host's config as the audit uses it (what its own loader returned, and what the audit reads of it)."""

    shape: BatchShape
    """The synthetic collection's shape."""
    stock: str
    """The stock aggregation as a formula with the config's values."""
    settings: dict
    """The keys that decide the aggregation and the split, with the config's values."""
    splits: list
    """``measure.Split`` per split the config allows, the configured one first."""
    fix: str
    """The one config line that makes the host's loss exact."""
    host: object = field(default=None, repr=False)
    """The host's own loaded config (its args or config object)."""


def command_line(config, overrides: list, argv: list) -> list:
    """A host's command line (Megatron-LM, slime): the argument file ``config`` (shell words, comments and
    line continuations allowed), then ``overrides``, then what followed ``--``."""
    args = []
    if config:
        with open(config) as f:
            args += shlex.split(f.read().replace("\\\n", " "), comments=True)
    return args + list(overrides) + list(argv)


def without_flags(argv: list, flags: tuple) -> list:
    """``argv`` less each of ``flags`` with its value (the audit's own, not the host's)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not any(arg.startswith(f + "=") for f in flags):
            out.append(arg)
    return out

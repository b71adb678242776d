"""The hosts' one objective type (megatron_pg_agg/integrations/objective.py): validated once, refused by each
host in its own keys and error class (no host package needed)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_pg_agg.integrations.areal.plugin import ArealConfigError, ArealSettings, use_pg_agg
from megatron_pg_agg.integrations.nemo_rl.plugin import NemoRLConfigError, settings_from_config
from megatron_pg_agg.integrations.objective import HostObjective, refused_as
from megatron_pg_agg.integrations.slime.plugin import SlimeConfigError, objective_from_args

NEEDS_DIVISOR = "mode='constant' needs divisor=L"


def test_the_objective_resolves_peers_names_and_refuses_what_resolve_mode_refuses():
    """Catches a host spelling kept (objectives that mean the same compare unequal), or a refusal
    of resolve_mode's lost on the way."""
    assert HostObjective("seq-mean-token-sum") == HostObjective("constant", 1) == HostObjective("constant", 1.0)
    assert HostObjective("grpo") == HostObjective("seq_mean") and HostObjective("constant", 512).divisor == 512.0
    for mode, divisor, error, words in (("constant", None, ValueError, NEEDS_DIVISOR),
                                        ("token_mean", 4, ValueError, "divisor=4 is only used by mode='constant'"),
                                        ("constant", 0, ValueError, "positive finite number"),
                                        ("tokenmean", None, ValueError, "unknown mode='tokenmean'"),
                                        (None, None, TypeError, "mode must be a string")):
        with pytest.raises(error, match=words):
            HostObjective(mode, divisor)


def test_each_host_refuses_the_same_objective_in_its_own_keys_and_error():
    """constant without L, read by every host: one reason (the shared validation), after each host's
    own keys, as each host's error class. Catches a host validating on its own, or naming another's keys."""
    refusals = [(SlimeConfigError, "pg_agg_mode='constant', pg_agg_divisor=None: ",
                 lambda: objective_from_args(SimpleNamespace(pg_agg_mode="constant"))),
                (NemoRLConfigError, "loss_fn.pg_agg={'mode': 'constant'}: ",
                 lambda: settings_from_config(SimpleNamespace(loss_fn=SimpleNamespace(pg_agg={"mode": "constant"})))),
                (ArealConfigError, "MEGATRON_PG_AGG_AREAL='constant': ", lambda: ArealSettings.decode("constant")),
                (ArealConfigError, "", lambda: use_pg_agg(SimpleNamespace(actor=None), "constant"))]
    for error, keys, read in refusals:
        with pytest.raises(error) as refused:
            read()
        assert str(refused.value).startswith(keys + NEEDS_DIVISOR), str(refused.value)
        assert isinstance(refused.value.__cause__, ValueError)


def test_refused_as_turns_type_and_value_errors_into_the_hosts_error():
    class HostError(ValueError):
        pass

    with pytest.raises(HostError, match=r"^key=3: mode must be a string"):
        with refused_as(HostError, "key=3"):
            HostObjective(3)
    with pytest.raises(HostError, match=r"^option 'x' given twice$"):
        with refused_as(HostError, None):
            raise ValueError("option 'x' given twice")
    with pytest.raises(KeyError):  # anything else is not a refusal: it passes through
        with refused_as(HostError, "key"):
            raise KeyError("x")

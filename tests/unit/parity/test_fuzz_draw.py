"""The fuzzer's host side: a case is a function of its seed; refused compositions are named; the
draw reaches every axis it claims (layouts, modes, losses, corrections, MoE, MTP, W = 0)."""
from collections import Counter

from megatron_pg_agg.core.losses import POLICY_LOSSES, ROLLOUT_CORRECTIONS
from megatron_pg_agg.core.modes import MODES
from megatron_pg_agg.parity.fuzz import _case_seed, draw_case, fuzz_rollouts, host_problem


def test_a_case_is_a_function_of_its_seed():
    assert draw_case(42) == draw_case(42) and draw_case(42) != draw_case(43)
    a, b = fuzz_rollouts(draw_case(42)), fuzz_rollouts(draw_case(42))
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    assert _case_seed(7, 3, 0) == _case_seed(7, 3, 0) != _case_seed(7, 3, 1)


def test_refused_compositions_are_named():
    def problem(**layout):
        case = draw_case(1)
        return host_problem(type(case)(seed=1, layout={**case.layout, **layout}, loss=case.loss, data=case.data))

    base = dict(tp=1, pp=1, vpp=None, cp=1, dp=1, ep=1, experts=0, mtp=False, per_token_model=False,
                max_tokens=None, num_microbatches=1)
    assert "attention heads" in problem(**{**base, "tp": 3})
    assert "layers" in problem(**{**base, "pp": 3})
    assert "Transformer Engine" in problem(**{**base, "cp": 2})
    assert "sequence parallelism" in problem(**{**base, "tp": 2, "experts": 4})
    assert "EP=2 does not divide DP=1" in problem(**{**base, "experts": 4, "ep": 2})
    assert "divisible by PP=2" in problem(**{**base, "pp": 2, "vpp": 2, "num_microbatches": 3})


def test_the_draw_reaches_every_axis():
    cases = [draw_case(_case_seed(0, i, 0)) for i in range(400)]
    accepted = [c for c in cases if host_problem(c) is None]
    assert len(accepted) > 150
    seen = Counter()
    for c in accepted:
        pc = c.parity_case
        seen.update({f"mode {c.loss['mode']}", f"loss {c.loss['policy_loss']}", f"world {c.world}",
                     f"correction {c.loss['rollout_correction']}"})
        seen.update(name for name, on in (("tp", pc.tp > 1), ("pp", pc.pp > 1), ("vpp", pc.vpp), ("cp", pc.cp > 1),
                                          ("dp", pc.dp > 1), ("ep", pc.ep > 1), ("moe", pc.experts), ("mtp", pc.mtp),
                                          ("capacity", pc.max_tokens), ("W=0", c.data["zero_step"]),
                                          ("kl", c.loss["kl_coef"]), ("entropy", c.loss["entropy_coef"])) if on)
    expected = {f"mode {m}" for m in MODES} | {f"loss {p}" for p in POLICY_LOSSES}
    expected |= {f"world {w}" for w in (1, 2, 3, 4)}
    expected |= {f"correction {k}" for k in ROLLOUT_CORRECTIONS}
    expected |= {"tp", "pp", "vpp", "cp", "dp", "ep", "moe", "mtp", "capacity", "W=0", "kl", "entropy"}
    assert expected <= set(seen), sorted(expected - set(seen))

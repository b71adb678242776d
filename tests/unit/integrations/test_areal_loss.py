"""The AReaL plug-in's step weights and loss on AReaL 1.0.4's own functions, one rank.

AReaL's optimizer-step split (the ``areal_actor`` patch's whole-group steps), its micro-batch
splitter (``split_padded_tensor_dict_into_mb_list``: FFD or Karmarkar-Karp, counts and token caps),
its packing (``pack_tensor_dict``) and its loss (``grpo_loss_fn``) run as AReaL's engine runs them,
with the engine's formula written out: micro-batch i back-propagates ``L_i * w_i / W``,
``w_i = loss_mask.count_nonzero()``, ``W = sum_i w_i``. The expected objective and gradient (with
respect to the current log-probs) come from the mode formulas written here, on a PPO-clip loss
written here (no package code), in float64. AReaL's statistics take float32 only, so its loss runs
in float32: the tolerances are float32's (1e-6 of max(|J|, 0.01) for J, 1e-5 for the gradient).
The multi-rank and engine cases: tests/distributed/test_areal.py.
"""
from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

from tests.support.optional import REQUIRE_AREAL, require

GROUPS = (3, 1, 4, 3)  # responses per prompt group (ragged; a singleton group, as AReaL's n_samples=1 gives)
EPS = 0.2
DIVISOR = 6.0


def _areal():
    require(None if importlib.util.find_spec("areal") else "AReaL is not installed (docs/areal.md)", REQUIRE_AREAL)


@pytest.fixture(autouse=True)
def _areal_statistics_start_empty():
    """AReaL's loss functions log into one module-level tracker, which AReaL's trainer empties
    (exports) after every update; a statistic logged on some calls only (the KD term's
    ``rkl_loss``) must not meet another test's denominators there."""
    if importlib.util.find_spec("areal") is not None:
        from areal.utils import stats_tracker

        tracker = stats_tracker.DEFAULT_TRACKER
        tracker.stats.clear()
        tracker.denominators.clear()
        tracker.reduce_types.clear()
    yield


def make_batch(seed: int = 0):
    """A padded AReaL batch of one rank: prompts then responses, loss_mask on response tokens (one
    response fully masked, one with a masked token), advantages per token, old and current
    log-probs near each other so that the clip is partly active."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for group, size in enumerate(GROUPS):
        for _ in range(size):
            prompt = int(torch.randint(1, 4, (), generator=g))
            response = int(torch.randint(1, 7, (), generator=g))
            rows.append((group, prompt, response))
    width = max(p + r for _, p, r in rows)
    bs = len(rows)
    attention = torch.zeros(bs, width, dtype=torch.bool)
    loss_mask = torch.zeros(bs, width, dtype=torch.float64)
    for i, (_, p, r) in enumerate(rows):
        attention[i, :p + r] = True
        loss_mask[i, p:p + r] = 1.0
    loss_mask[4] = 0.0  # a fully masked response
    loss_mask[1, rows[1][1]] = 0.0  # a masked token
    old = -torch.rand(bs, width, generator=g, dtype=torch.float64) * 2 - 0.5
    current = old + 0.3 * torch.randn(bs, width, generator=g, dtype=torch.float64)
    data = {
        "input_ids": torch.randint(0, 50, (bs, width), generator=g) * attention,
        "attention_mask": attention,
        "loss_mask": loss_mask * attention,
        "logprobs": old * attention,
        "prox_logp": old * attention,  # what compute_advantages sets without the decoupled loss
        # mostly positive, so that J is of order 1: float32's rounding of AReaL's sums stays far below
        # the 1e-6 check (advantages of both signs cancel to a J near 0 from terms of order 1)
        "advantages": (torch.randn(bs, width, generator=g, dtype=torch.float64) + 1.0) * attention,
        "pg_agg_group": torch.tensor([grp for grp, _, _ in rows]).unsqueeze(1).expand(bs, width).clone(),
    }
    data = {k: (v.float() if v.dtype == torch.float64 else v) for k, v in data.items()}
    return data, (current * attention).float(), rows


def reference(data, current, rows, mode: str, numerator=None):
    """J of the whole step from the formulas: pg_t = -min(A r, A clip(r)), r = exp(logp - prox),
    summed over ``numerator`` (default: the loss mask), divided by the units of the loss mask."""
    ratio = torch.exp(current.double() - data["prox_logp"].double())
    adv = data["advantages"].double()
    pg = -torch.min(adv * ratio, adv * ratio.clamp(1 - EPS, 1 + EPS))
    return aggregated(pg, data, rows, mode, numerator)


def aggregated(per_token, data, rows, mode: str, numerator=None):
    """The README's modes on a per-token loss: summed over ``numerator`` (default: the loss mask),
    divided by the units of the loss mask (float64)."""
    mask = data["loss_mask"].bool()
    numerator = mask if numerator is None else numerator
    per_row = torch.where(numerator, per_token, 0.0).sum(1)
    counts = mask.sum(1)
    active = counts > 0
    if mode == "token_mean":
        return per_row.sum() / counts.sum()
    if mode == "seq_mean":
        return (per_row[active] / counts[active]).sum() / active.sum()
    if mode == "constant":
        return per_row.sum() / (active.sum() * DIVISOR)
    groups = torch.tensor([grp for grp, _, _ in rows])
    total = 0.0
    n_groups = 0
    for grp in groups.unique():
        tokens = counts[groups == grp].sum()
        if tokens > 0:
            total = total + per_row[groups == grp].sum() / tokens
            n_groups += 1
    return total / n_groups


def engine_objective(data, current, mode, *, n_steps, mb_spec, loss=None, m2_threshold=None, plugin=True, wrap=True):
    """The plug-in's objective under AReaL's splits and the engine's arithmetic, summed over the
    optimizer steps (each step's share of J; the steps here all start from the same weights).
    ``wrap=False``: the step prepared by the plug-in, ``loss`` handed the micro-batches as is."""
    from areal.api.cli_args import MicroBatchSpec
    from areal.trainer.ppo.actor import grpo_loss_fn
    from areal.utils.data import pack_tensor_dict, split_padded_tensor_dict_into_mb_list

    from megatron_pg_agg.integrations.areal.loss import exact_loss_fn, prepare_step, take_rows, whole_group_minibatches

    loss = loss or functools.partial(grpo_loss_fn, eps_clip=EPS, eps_clip_higher=None, c_clip=None)
    data = {**data, "_current": current}
    total = 0.0
    for rows in whole_group_minibatches(data, n_steps):
        step = take_rows(data, rows)
        if plugin:
            step = prepare_step(step, mode=mode, divisor=DIVISOR if mode == "constant" else None,
                                m2_threshold=m2_threshold)
        mbs = split_padded_tensor_dict_into_mb_list(step, MicroBatchSpec(**mb_spec)).mbs
        packed = [pack_tensor_dict(mb) for mb in mbs]
        weights = [mb["loss_mask"].count_nonzero() for mb in packed]
        W = sum(weights)
        wrapped = exact_loss_fn(loss) if plugin and wrap else loss
        for mb, w in zip(packed, weights):
            if w == 0:  # the engine skips a micro-batch of weight 0 (output.mean() * 0)
                continue
            logp = mb.pop("_current")
            total = total + wrapped(logp, torch.zeros_like(logp), mb) * w / W
    return total


SPLITS = [
    dict(n_mbs=1),
    dict(n_mbs=3),
    dict(n_mbs=2, max_tokens_per_mb=12),
    dict(n_mbs=1, max_tokens_per_mb=9, packing_algorithm="kk"),
]


@pytest.mark.optional_stack
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "prompt_mean", "constant"])
def test_every_split_gives_the_reference_objective_and_gradient(mode):
    """One optimizer step (ppo_n_minibatches=1) under four micro-batch splits: J and dJ/dlogp equal
    the float64 formulas to float32 rounding. Catches a wrong c_t, the D/W scale, n_i/w_i inverted, or the
    numerator not handed to AReaL's loss."""
    _areal()
    data, current, rows = make_batch()
    ref_current = current.detach().double().requires_grad_(True)
    expected = reference(data, ref_current, rows, mode)
    (ref_grad,) = torch.autograd.grad(expected, ref_current)
    for spec in SPLITS:
        mine = current.detach().requires_grad_(True)
        got = engine_objective(data, mine, mode, n_steps=1, mb_spec=spec)
        (grad,) = torch.autograd.grad(got, mine)
        assert abs(float(got) - float(expected)) <= 1e-6 * max(abs(float(expected)), 0.01), (mode, spec)
        assert float((grad.double() - ref_grad).norm()) <= 1e-5 * float(ref_grad.norm()), (mode, spec)


@pytest.mark.optional_stack
def test_the_naive_swap_and_stock_token_mean_differ_as_expected():
    """Controls: AReaL's stock loss (no plug-in) is the token mean under every split, and a
    seq-mean computed per micro-batch under AReaL's token weight (the loss alone swapped) is not
    the seq mean once a step has several micro-batches (the plug-in's test above is, under the
    same splits)."""
    _areal()
    from areal.api.cli_args import MicroBatchSpec
    from areal.trainer.ppo.actor import grpo_loss_fn
    from areal.utils.data import pack_tensor_dict, split_padded_tensor_dict_into_mb_list

    data, current, rows = make_batch()
    loss = functools.partial(grpo_loss_fn, eps_clip=EPS, eps_clip_higher=None, c_clip=None)

    def stock(spec, per_sequence=False):
        mbs = [pack_tensor_dict(mb) for mb in split_padded_tensor_dict_into_mb_list(
            {**data, "_current": current}, MicroBatchSpec(**spec)).mbs]
        weights = [mb["loss_mask"].count_nonzero() for mb in mbs]
        total = 0.0
        for mb, w in zip(mbs, weights):
            logp = mb.pop("_current")
            if w == 0:
                continue
            if per_sequence:  # the naive swap: a seq-mean of this micro-batch's sequences
                cu = mb["cu_seqlens"].tolist()
                seqs = [(a, b) for a, b in zip(cu, cu[1:]) if mb["loss_mask"][a:b].sum() > 0]
                parts = [loss(logp[a:b], logp[a:b] * 0, {k: (v[a:b] if torch.is_tensor(v) and v.dim() == 1 and
                                                             v.shape[0] == logp.shape[0] else v)
                                                         for k, v in mb.items()}) for a, b in seqs]
                value = sum(parts) / len(parts)
            else:
                value = loss(logp, logp * 0, mb)
            total = total + value * w / sum(weights)
        return total

    token = reference(data, current, rows, "token_mean")
    seq = reference(data, current, rows, "seq_mean")
    for spec in SPLITS:
        assert abs(float(stock(spec)) - float(token)) <= 1e-6 * max(abs(float(token)), 0.01)
    naive = [float(stock(spec, per_sequence=True)) for spec in SPLITS]
    # with one micro-batch the naive swap is the seq mean; cut into several it is not, and it moves
    assert abs(naive[0] - float(seq)) <= 1e-6 * abs(float(seq))
    assert min(abs(n - float(seq)) for n in naive[1:]) > 1e-3 * abs(float(seq)), naive
    assert max(naive) - min(naive) > 1e-3 * abs(float(seq))


@pytest.mark.optional_stack
@pytest.mark.parametrize("n_steps", [2, 3])
def test_optimizer_steps_hold_whole_groups(n_steps):
    """ppo_n_minibatches > 1: every group lies in one step (the patch's split), every row in
    exactly one, and prompt_mean summed over the steps is the sum of each step's own reference.
    Catches a group cut across steps (AReaL's own FFD split cuts 2 of 4 here)."""
    _areal()
    from megatron_pg_agg.integrations.areal.loss import take_rows, whole_group_minibatches

    data, current, rows = make_batch()
    steps = whole_group_minibatches(data, n_steps)
    assert sorted(r for s in steps for r in s) == list(range(len(rows)))
    for s in steps:
        groups = {rows[r][0] for r in s}
        assert all(sum(1 for r in s if rows[r][0] == grp) == GROUPS[grp] for grp in groups)
    expected = sum(reference(take_rows(data, s), current[s], [rows[r] for r in s], "prompt_mean") for s in steps)
    got = engine_objective(data, current, "prompt_mean", n_steps=n_steps, mb_spec=dict(n_mbs=2))
    assert abs(float(got) - float(expected)) <= 1e-6 * max(abs(float(expected)), 0.01)


@pytest.mark.optional_stack
def test_more_steps_than_groups_is_refused_naming_the_key():
    _areal()
    from megatron_pg_agg.integrations.areal.loss import ArealBatchError, whole_group_minibatches

    data, _, _ = make_batch()
    with pytest.raises(ArealBatchError, match="actor.ppo_n_minibatches=5.*4 group"):
        whole_group_minibatches(data, 5)


M2 = 0.02


@pytest.mark.optional_stack
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "prompt_mean", "constant"])
def test_m2po_is_chosen_once_per_step_and_exact_under_every_split(mode):
    """M2PO on (actor.m2_threshold): the tokens it drops are chosen once over the step (AReaL's own
    _apply_m2po_masking on the whole step) and leave the numerator only (the filtered-numerator
    rule); every split then gives that objective. Control: AReaL's stock M2PO, chosen per
    micro-batch and divided by the kept count, moves with the split (AReaL issue #1730). Catches
    the selection made per micro-batch, n_i / w_i inverted or dropped, or the dropped tokens taken
    out of the denominator."""
    _areal()
    from areal.trainer.ppo.actor import _apply_m2po_masking, grpo_loss_fn

    data, current, rows = make_batch(seed=3)
    g = torch.Generator().manual_seed(5)
    noise = 0.3 * torch.randn(data["logprobs"].shape, generator=g)
    data["prox_logp"] = data["logprobs"] + noise * data["attention_mask"]
    keep = _apply_m2po_masking(data["logprobs"], data["prox_logp"], data["loss_mask"].bool(), M2)
    dropped = int((data["loss_mask"].bool() & ~keep).sum())
    assert 0 < dropped < int(data["loss_mask"].sum()) // 2, dropped  # the selection is active, not total
    ref_current = current.detach().double().requires_grad_(True)
    expected = reference(data, ref_current, rows, mode, numerator=keep)
    (ref_grad,) = torch.autograd.grad(expected, ref_current)
    loss = functools.partial(grpo_loss_fn, eps_clip=EPS, eps_clip_higher=None, c_clip=None, m2_threshold=M2)
    for spec in SPLITS:
        mine = current.detach().requires_grad_(True)
        got = engine_objective(data, mine, mode, n_steps=1, mb_spec=spec, loss=loss, m2_threshold=M2)
        (grad,) = torch.autograd.grad(got, mine)
        assert abs(float(got) - float(expected)) <= 1e-6 * max(abs(float(expected)), 0.01), (mode, spec)
        assert float((grad.double() - ref_grad).norm()) <= 1e-5 * float(ref_grad.norm()), (mode, spec)
    if mode == "token_mean":  # the control: AReaL's own M2PO, the same batch and splits
        stock = []
        for spec in SPLITS:
            mine = current.detach().requires_grad_(True)
            value = engine_objective(data, mine, mode, n_steps=1, mb_spec=spec, loss=loss, plugin=False)
            stock.append(torch.autograd.grad(value, mine)[0].double())
        moved = max(float((s - stock[0]).norm()) / float(stock[0].norm()) for s in stock[1:])
        assert moved > 1e-2, moved
        print(f"AReaL's stock M2PO: gradient moved by up to {moved:.1%} with the split alone")


@pytest.mark.optional_stack
def test_token_mean_through_the_plugin_is_areals_own_loss_bit_for_bit():
    """token_mean: c_t * D / W is exactly 1 and n_i / w_i is 1 without filtering, so AReaL's loss
    sees its own advantages: the same value and gradient, bit for bit, under a 3-micro-batch split
    (PR #1546's 'token_mean preserves the existing reduction path')."""
    _areal()
    from areal.api.cli_args import MicroBatchSpec
    from areal.trainer.ppo.actor import grpo_loss_fn
    from areal.utils.data import pack_tensor_dict, split_padded_tensor_dict_into_mb_list

    from megatron_pg_agg.integrations.areal.loss import exact_loss_fn, prepare_step

    data, current, _ = make_batch()
    loss = functools.partial(grpo_loss_fn, eps_clip=EPS, eps_clip_higher=None, c_clip=None)
    step = prepare_step({**data, "_current": current}, mode="token_mean", divisor=None)
    for mb in split_padded_tensor_dict_into_mb_list(step, MicroBatchSpec(n_mbs=3)).mbs:
        packed = pack_tensor_dict(mb)
        if packed["loss_mask"].count_nonzero() == 0:
            continue
        a = packed["_current"].detach().requires_grad_(True)
        b = packed["_current"].detach().requires_grad_(True)
        ours, theirs = exact_loss_fn(loss)(a, a * 0, packed), loss(b, b * 0, packed)
        assert torch.equal(ours, theirs)
        assert torch.equal(torch.autograd.grad(ours, a)[0], torch.autograd.grad(theirs, b)[0])


@pytest.mark.optional_stack
def test_a_step_the_objective_cannot_take_is_refused_by_name():
    """prompt_mean without the plug-in's group marks (its ppo_update did not run). AReaL's
    distillation term is no longer refused (its own term: the tests below)."""
    _areal()
    from megatron_pg_agg.integrations.areal.loss import COEF, GROUP, ArealBatchError, prepare_step

    data, _, _ = make_batch()
    unmarked = {k: v for k, v in data.items() if k != GROUP}
    with pytest.raises(ArealBatchError, match="prompt_mean needs the prompt groups"):
        prepare_step(unmarked, mode="prompt_mean", divisor=None)
    assert COEF in prepare_step({**data, "teacher_logp": data["logprobs"]}, mode="token_mean", divisor=None)


# ---- AReaL's distillation term (teacher_logp): AReaL's token mean over the step, a term of its own

RL_WEIGHT, DISTILL_WEIGHT = 0.7, 0.3
"""AReaL's teacher.rl_loss_weight and teacher.distill_loss_weight (its defaults are 1 and 0.005:
larger here, so that a wrong KD term moves J well past float32's rounding)."""


def with_teacher(data, rl_loss_weight):
    """The batch with AReaL's distillation fields as its trainer writes them: per-token
    ``teacher_logp`` (the student's old log-probs moved by noise) and the two weights (floats)."""
    g = torch.Generator().manual_seed(11)
    teacher = data["logprobs"] + 0.4 * torch.randn(data["logprobs"].shape, generator=g)
    return {**data, "teacher_logp": teacher * data["attention_mask"], "rl_loss_weight": rl_loss_weight,
            "distill_loss_weight": DISTILL_WEIGHT}


def distill_reference(data, current, rows, mode, rl_loss_weight, numerator=None):
    """J = rl * J_pg(mode, numerator) + dw * (1/D) sum_t d_t kd_t, with kd_t = logp - teacher
    (joint), or, for rl = 0 (pure KD), J = dw * (1/D) sum_t d_t (-exp(logp - old) (teacher - sg(logp)))."""
    current = current.double()
    teacher = data["teacher_logp"].double()
    if rl_loss_weight == 0:
        kd = -torch.exp(current - data["logprobs"].double()) * (teacher - current.detach())
        return DISTILL_WEIGHT * aggregated(kd, data, rows, "token_mean")
    kd = current - teacher
    return rl_loss_weight * reference(data, current, rows, mode, numerator) + \
        DISTILL_WEIGHT * aggregated(kd, data, rows, "token_mean")


@pytest.mark.optional_stack
@pytest.mark.parametrize("m2po", [False, True], ids=["no-m2po", "m2po"])
@pytest.mark.parametrize("rl_loss_weight", [RL_WEIGHT, 0.0], ids=["joint", "pure-kd"])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "prompt_mean", "constant"])
def test_distillation_is_a_token_mean_of_its_own_under_every_split(mode, rl_loss_weight, m2po):
    """AReaL's KD term through the plug-in: rl_loss_weight * (the mode's J_pg) + distill_loss_weight
    * (the KD term's token mean over every valid token of the step), under every split, with M2PO
    choosing the PG numerator (its dropped tokens stay in the KD term: a per-token regulariser,
    like the project's KL) and without; pure KD (rl_loss_weight 0) is the KD token mean alone, in
    every mode. Catches the KD term divided by the numerator's count n_i (M2PO) or put on it, the
    KD term scaled by the PG mode's c_t, rl_loss_weight dropped, or the KD term counted twice."""
    _areal()
    from areal.trainer.ppo.actor import _apply_m2po_masking, grpo_loss_fn

    data, current, rows = make_batch(seed=3)
    numerator, threshold = None, None
    if m2po:
        g = torch.Generator().manual_seed(5)
        data["prox_logp"] = data["logprobs"] + 0.3 * torch.randn(data["logprobs"].shape, generator=g) * \
            data["attention_mask"]
        numerator = _apply_m2po_masking(data["logprobs"], data["prox_logp"], data["loss_mask"].bool(), M2)
        threshold = M2
    data = with_teacher(data, rl_loss_weight)
    ref_current = current.detach().double().requires_grad_(True)
    expected = distill_reference(data, ref_current, rows, mode, rl_loss_weight, numerator)
    (ref_grad,) = torch.autograd.grad(expected, ref_current)
    loss = functools.partial(grpo_loss_fn, eps_clip=EPS, eps_clip_higher=None, c_clip=None, m2_threshold=threshold)
    for spec in SPLITS:
        mine = current.detach().requires_grad_(True)
        got = engine_objective(data, mine, mode, n_steps=1, mb_spec=spec, loss=loss, m2_threshold=threshold)
        (grad,) = torch.autograd.grad(got, mine)
        assert abs(float(got) - float(expected)) <= 1e-6 * max(abs(float(expected)), 0.01), (mode, spec)
        assert float((grad.double() - ref_grad).norm()) <= 1e-5 * float(ref_grad.norm()), (mode, spec)


@pytest.mark.optional_stack
def test_control_the_kd_term_inside_the_pg_call_misses_under_m2po():
    """The one-call form (AReaL's grpo_loss_fn with the teacher beside the scaled advantages and
    the numerator mask, as the plug-in called it before): its KD term is summed over M2PO's kept
    tokens and divided by their count per micro-batch, so it moves with the split and misses the
    token mean the two-call form gives (the test above)."""
    _areal()
    from areal.trainer.ppo.actor import grpo_loss_fn

    from megatron_pg_agg.integrations.areal.loss import COEF, NUMERATOR

    data, current, rows = make_batch(seed=3)
    g = torch.Generator().manual_seed(5)
    data["prox_logp"] = data["logprobs"] + 0.3 * torch.randn(data["logprobs"].shape, generator=g) * \
        data["attention_mask"]
    data = with_teacher(data, RL_WEIGHT)
    loss = functools.partial(grpo_loss_fn, eps_clip=EPS, eps_clip_higher=None, c_clip=None)

    def one_call(logprobs, entropy, mb, **kwargs):
        numerator = mb[NUMERATOR].bool()
        k = mb[COEF] * (numerator.sum().clamp(min=1) / mb["loss_mask"].bool().sum())
        return loss(logprobs, entropy, {**mb, "advantages": mb["advantages"] * k, "loss_mask": numerator})

    expected = float(distill_reference(data, current, rows, "token_mean", RL_WEIGHT,
                                       _m2po_keep(data)))
    got = []
    for spec in SPLITS:
        got.append(float(engine_objective(data, current, "token_mean", n_steps=1, mb_spec=spec, loss=one_call,
                                          m2_threshold=M2, wrap=False)))
    assert max(abs(v - expected) for v in got) > 1e-3 * abs(expected), (got, expected)


def _m2po_keep(data):
    from areal.trainer.ppo.actor import _apply_m2po_masking

    return _apply_m2po_masking(data["logprobs"], data["prox_logp"], data["loss_mask"].bool(), M2)


@pytest.mark.optional_stack
def test_the_two_call_kd_loss_logs_areals_statistics_once_per_micro_batch():
    """AReaL's statistics of a joint KD step through the plug-in: one entry per micro-batch in
    its tracker (the second, KD-only call logs to a scratch tracker), rkl_loss among them, and the
    tracker's module functions restored after. Catches the KD call's statistics leaking (AReaL's
    denominator and value lists would no longer pair up, and its export would fail or mix them)."""
    _areal()
    from areal.api.cli_args import MicroBatchSpec
    from areal.trainer.ppo.actor import grpo_loss_fn
    from areal.utils import stats_tracker
    from areal.utils.data import pack_tensor_dict, split_padded_tensor_dict_into_mb_list

    from megatron_pg_agg.integrations.areal.loss import exact_loss_fn, prepare_step

    data, current, _ = make_batch()
    data = with_teacher(data, RL_WEIGHT)
    own = (stats_tracker.stat, stats_tracker.denominator, stats_tracker.scalar)
    loss = exact_loss_fn(functools.partial(grpo_loss_fn, eps_clip=EPS, eps_clip_higher=None, c_clip=None))
    step = prepare_step({**data, "_current": current}, mode="seq_mean", divisor=None)
    mbs = [pack_tensor_dict(mb) for mb in split_padded_tensor_dict_into_mb_list(step, MicroBatchSpec(n_mbs=3)).mbs]
    for mb in mbs:
        logp = mb.pop("_current")
        loss(logp, logp * 0, mb)
    tracker = stats_tracker.DEFAULT_TRACKER
    assert len(tracker.stats["n_valid_tokens"]) == len(mbs) == len(tracker.stats["rkl_loss"]), \
        {k: len(v) for k, v in tracker.stats.items()}
    assert (stats_tracker.stat, stats_tracker.denominator, stats_tracker.scalar) == own
    assert "rkl_loss/avg" in stats_tracker.export()


# ---- AReaL's critic: the value term in the chosen mode

VALUE_EPS = 0.1
"""critic.eps_clip: small enough that the clipped branch is the larger one on part of the batch."""


def make_critic_batch(seed: int = 0):
    """The unit batch as AReaL's critic step receives it: ``values`` (V_old, the critic's own
    before the update), ``returns``, the rolled loss mask, the group marks; and the current values
    V (V_old moved by noise, so that the clip is partly active)."""
    data, _, rows = make_batch(seed)
    g = torch.Generator().manual_seed(seed + 20)
    attention = data["attention_mask"]
    old = 0.3 * torch.randn(attention.shape, generator=g)
    current = old + 0.15 * torch.randn(attention.shape, generator=g)
    returns = torch.tensor([[1.0], [0.0], [0.5]]).repeat(6, 1)[:attention.shape[0]] + 0.1 * torch.randn(
        attention.shape, generator=g)
    critic = {k: data[k] for k in ("input_ids", "attention_mask", "loss_mask", "pg_agg_group")}
    critic.update(values=old * attention, returns=returns * attention)
    return critic, (current * attention).float(), rows


def value_reference(data, current, rows, mode):
    """J_v from the formulas (float64): v_t = 0.5 max((V - R)^2, (clip(V, V_old +- eps) - R)^2)."""
    current = current.double()
    old, ret = data["values"].double(), data["returns"].double()
    clipped = torch.minimum(torch.maximum(current, old - VALUE_EPS), old + VALUE_EPS)
    v = 0.5 * torch.maximum((current - ret) ** 2, (clipped - ret) ** 2)
    return aggregated(v, data, rows, mode)


def critic_objective(data, current, mode, *, n_steps, mb_spec, plugin=True):
    """The critic's objective under AReaL's splits and the engine's arithmetic (L_i w_i / W per
    micro-batch, w_i the loss mask's count), with AReaL's own ppo_loss_fn partial handed in as
    AReaL's PPOCritic hands it (plugin=False: that loss as is, AReaL's stock critic)."""
    from areal.api.cli_args import MicroBatchSpec
    from areal.trainer.ppo.critic import ppo_loss_fn
    from areal.utils.data import pack_tensor_dict, split_padded_tensor_dict_into_mb_list

    from megatron_pg_agg.core.value import ValueLossConfig
    from megatron_pg_agg.integrations.areal.loss import (
        exact_value_loss_fn,
        prepare_step,
        take_rows,
        value_clip_eps,
        whole_group_minibatches,
    )

    loss = functools.partial(ppo_loss_fn, eps_clip=VALUE_EPS)
    data = {**data, "_current": current}
    total = 0.0
    every_row = list(range(data["attention_mask"].shape[0]))
    steps = whole_group_minibatches(data, n_steps, "critic.ppo_n_minibatches") if plugin else [every_row]
    for rows_of_step in steps:
        step = take_rows(data, rows_of_step)
        wrapped = loss
        if plugin:
            step = prepare_step(step, mode=mode, divisor=DIVISOR if mode == "constant" else None)
            wrapped = exact_value_loss_fn(loss, ValueLossConfig(clip_eps=value_clip_eps(loss), factor=0.5))
        mbs = split_padded_tensor_dict_into_mb_list(step, MicroBatchSpec(**mb_spec)).mbs
        packed = [pack_tensor_dict(mb) for mb in mbs]
        weights = [mb["loss_mask"].count_nonzero() for mb in packed]
        for mb, w in zip(packed, weights):
            if w == 0:
                continue
            values = mb.pop("_current")
            total = total + wrapped(values, mb) * w / sum(weights)
    return total


@pytest.mark.optional_stack
@pytest.mark.parametrize("n_steps", [1, 2])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "prompt_mean", "constant"])
def test_the_critic_loss_is_exact_under_every_split(mode, n_steps):
    """AReaL's critic step through the plug-in (its ppo_loss_fn partial, eps read off it; AReaL's
    splitter, packing and engine weights): each optimizer step's J_v and dJ_v/dV equal the float64
    formulas in every mode, under four micro-batch splits and 1 or 2 steps of whole groups. Catches
    a wrong c^v_t or D/W, the micro-batch weight w_i not divided out, the clip not AReaL's (eps, the
    max of the two branches, the 0.5), or the clip range not read from AReaL's partial."""
    _areal()
    from megatron_pg_agg.integrations.areal.loss import take_rows, whole_group_minibatches

    data, current, rows = make_critic_batch()
    steps = whole_group_minibatches(data, n_steps)
    ref_current = current.detach().double().requires_grad_(True)
    expected = sum(value_reference(take_rows(data, s), ref_current[s], [rows[r] for r in s], mode) for s in steps)
    (ref_grad,) = torch.autograd.grad(expected, ref_current)
    clipped = _clip_binds(data, current)
    assert 0 < clipped < int(data["loss_mask"].sum()), clipped  # both branches of AReaL's max are taken
    for spec in SPLITS:
        mine = current.detach().requires_grad_(True)
        got = critic_objective(data, mine, mode, n_steps=n_steps, mb_spec=spec)
        (grad,) = torch.autograd.grad(got, mine)
        assert abs(float(got) - float(expected)) <= 1e-6 * max(abs(float(expected)), 0.01), (mode, spec)
        assert float((grad.double() - ref_grad).norm()) <= 1e-5 * float(ref_grad.norm()), (mode, spec)


def _clip_binds(data, current) -> int:
    old, ret = data["values"].double(), data["returns"].double()
    current = current.double()
    clipped = torch.minimum(torch.maximum(current, old - VALUE_EPS), old + VALUE_EPS)
    return int(((clipped - ret) ** 2 > (current - ret) ** 2)[data["loss_mask"].bool()].sum())


@pytest.mark.optional_stack
def test_control_areals_stock_critic_is_the_token_mean_and_not_the_seq_mean():
    """AReaL's own critic loss (plug-in off, its own split of one step): the token mean of the
    float64 formula under every split (what the plug-in's token_mean equals above), and not the
    seq mean (which the plug-in's seq_mean equals)."""
    _areal()
    data, current, rows = make_critic_batch()
    token = float(value_reference(data, current, rows, "token_mean"))
    seq = float(value_reference(data, current, rows, "seq_mean"))
    for spec in SPLITS:
        stock = float(critic_objective(data, current, "token_mean", n_steps=1, mb_spec=spec, plugin=False))
        assert abs(stock - token) <= 1e-6 * max(abs(token), 0.01), spec
        assert abs(stock - seq) > 1e-2 * abs(seq)


@pytest.mark.optional_stack
def test_the_critic_clip_range_is_read_off_areals_partial():
    _areal()
    from areal.trainer.ppo.critic import ppo_loss_fn

    from megatron_pg_agg.integrations.areal.loss import ArealBatchError, value_clip_eps

    assert value_clip_eps(functools.partial(ppo_loss_fn, eps_clip=0.25)) == 0.25
    with pytest.raises(ArealBatchError, match="cannot read critic.eps_clip"):
        value_clip_eps(ppo_loss_fn)

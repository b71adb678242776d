"""The next plan in the background (megatron_pg_agg/data/plan_ahead.py) and its use by the
rollout feed of Megatron-LM's pretrain() entry: the same plans as the synchronous loop, in order,
each built while the previous one is in use; a plan's error raised by the request of that plan
(not earlier, not lost); the switch off plans in the caller's thread; no thread left behind."""
from __future__ import annotations

import dataclasses
import gc
import threading
import time
import weakref

import pytest
import torch

from megatron_pg_agg.core.aggregation import TokenWeights
from megatron_pg_agg.core.losses import PGLossConfig
from megatron_pg_agg.data.feed import RolloutFeed
from megatron_pg_agg.data.plan_ahead import PlanAhead, PlanOrderError
from megatron_pg_agg.data.planner import PlanConfig, plan_step
from megatron_pg_agg.data.rollout_files import RolloutFormatError
from megatron_pg_agg.data.rollouts import PlanError, RolloutBatch
from megatron_pg_agg.data.synthetic import synthetic_rollouts
from tests.support.rollouts import with_engine_logprobs

WAIT_S = 10.0  # generous bound on a background event (never reached when the code is right)


def assert_same(a, b, where="plan") -> None:
    """Every field of two plans equal, tensors by dtype, shape and value (``torch.equal``)."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, TokenWeights):
        assert a.mode == b.mode, where
        assert_same(a.coef, b.coef, f"{where}.coef")
        assert_same(a.count, b.count, f"{where}.count")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _steps() -> dict:
    rollouts = with_engine_logprobs(synthetic_rollouts(num_steps=4, vocab_size=128, seed=3))
    return {k: RolloutBatch.from_rollouts(v) for k, v in rollouts.items()}


LOSS = PGLossConfig(mode="seq_mean", kl_coef=0.05, rollout_correction="token_truncate")


@pytest.mark.parametrize("plan_cfg,cp_rank", [
    (PlanConfig(dp_size=2, num_microbatches=2), 0),
    (PlanConfig(dp_size=2, num_microbatches=2, tp_size=2, cp_size=2, vocab_size=128), 1),
])
def test_background_plans_equal_the_synchronous_ones_tensor_by_tensor(plan_cfg, cp_rank):
    """Six iterations over four rollout steps (a correction, so correction_stats too; CP rank 1 of
    2): each plan handed out equals plan_step's, field by field and tensor by tensor, and was built
    on the background thread. Would catch a plan of the wrong key (an off-by-one in the order, the
    previous plan returned again), a plan shared across keys, or a thread that plans something else
    than the synchronous call would."""
    steps = _steps()
    keys = sorted(steps)
    threads = {}

    def plan(i):
        threads[i] = threading.current_thread()
        return plan_step(steps[keys[i % 4]], LOSS, plan_cfg, cp_rank=cp_rank)

    with PlanAhead(plan, range(6)) as plans:
        got = [plans.get(i) for i in range(6)]
    for i, p in enumerate(got):
        assert_same(p, plan_step(steps[keys[i % 4]], LOSS, plan_cfg, cp_rank=cp_rank), f"iteration {i}")
        assert threads[i] is not threading.main_thread() and threads[i].daemon
    assert got[0].correction_stats is not None


def test_the_next_plan_is_built_while_the_current_one_is_in_use():
    """Handing out plan k starts plan k + 1 in the background at once (no further request): plan 1
    finishes while the caller still holds plan 0, and plan 2 has not started then. Would catch a
    plan started only when requested (no overlap) or more than one plan ahead (memory)."""
    started = {i: threading.Event() for i in range(4)}

    def plan(i):
        started[i].set()
        return {"key": i}

    plans = PlanAhead(plan, range(4))
    assert plans.get(0) == {"key": 0}
    assert started[1].wait(WAIT_S)  # planned with no request for it
    time.sleep(0.05)
    assert not started[2].is_set()  # one ahead, not two
    assert plans.get(0) == {"key": 0}  # the current plan again: kept, not replanned
    assert plans.get(1) == {"key": 1} and started[2].wait(WAIT_S)
    plans.close()


def test_a_failed_plan_is_raised_by_the_request_of_that_plan_with_its_file_and_line():
    """Plan 2 fails in the background (a rollout file's error naming its path and line) while the
    caller uses plan 1: get(1) succeeds, get(2) raises that very exception (type, message, line),
    again on a second request; nothing is planned ahead after it, and the next key is planned in the
    caller's thread when asked for. Would catch an error raised early (by get(1) or by the thread),
    swallowed (None returned), rewritten (file or line lost) or a run that keeps planning ahead."""
    error = RolloutFormatError("rollouts.jsonl", "is 3.5; expected an integer", line=17, field="step")
    failed, calls = threading.Event(), []

    def plan(i):
        calls.append((i, threading.current_thread() is threading.main_thread()))
        if i == 2:
            failed.set()
            raise error
        return i

    plans = PlanAhead(plan, range(4))
    assert plans.get(0) == 0
    assert plans.get(1) == 1
    assert failed.wait(WAIT_S)
    time.sleep(0.05)
    with pytest.raises(RolloutFormatError) as caught:
        plans.get(2)
    assert caught.value is error and str(caught.value).startswith("rollouts.jsonl:17: field 'step': ")
    with pytest.raises(RolloutFormatError):
        plans.get(2)
    assert [i for i, _ in calls] == [0, 1, 2]  # nothing ahead after the failure
    assert plans.get(3) == 3 and calls[-1] == (3, True)
    plans.close()


def test_a_planner_error_of_a_later_rollout_step_surfaces_at_its_iteration():
    """The real planner: rollout step 2's token ids outside the vocabulary (the Megatron-LM entry
    checks them when it plans): iterations 0 and 1 are handed out, iteration 2 raises the
    planner's PlanError naming rollout, field and position, as the synchronous call does."""
    steps = _steps()
    bad = steps[2]
    steps[2] = dataclasses.replace(bad, response_tokens=bad.response_tokens.clone())
    steps[2].response_tokens[5] = 200
    plan_cfg = PlanConfig(dp_size=1, num_microbatches=2, vocab_size=128)
    with pytest.raises(PlanError) as sync:
        plan_step(steps[2], LOSS, plan_cfg)
    with PlanAhead(lambda i: plan_step(steps[i], LOSS, plan_cfg), range(4)) as plans:
        plans.get(0)
        plans.get(1)
        with pytest.raises(PlanError) as caught:
            plans.get(2)
    assert str(caught.value) == str(sync.value) and "outside the vocabulary" in str(caught.value)
    assert (caught.value.rollout, caught.value.field) == (sync.value.rollout, sync.value.field)


def test_switched_off_every_plan_is_built_in_the_callers_thread_when_asked_for():
    """enabled=False: no thread is started, plan k is built by get(k) and by nothing before it.
    Would catch a switch that does not switch (a thread, a plan built ahead)."""
    calls = []
    before = threading.active_count()

    def plan(i):
        calls.append((i, threading.current_thread() is threading.main_thread()))
        return i * 10

    plans = PlanAhead(plan, range(3), enabled=False)
    assert calls == [] and threading.active_count() == before
    assert plans.get(0) == 0 and calls == [(0, True)]
    assert plans.get(0) == 0 and calls == [(0, True)]
    assert plans.get(1) == 10 and calls == [(0, True), (1, True)]
    assert threading.active_count() == before
    with pytest.raises(ValueError):
        PlanAhead(lambda i: (_ for _ in ()).throw(ValueError("bad")), range(1), enabled=False).get(0)


def test_out_of_order_requests_are_refused():
    """Only the current key or the next one in order: anything else (skipping, going back, past
    the end) is a PlanOrderError. Would catch a silently wrong plan for a skipped key."""
    with PlanAhead(lambda i: i, range(3)) as plans:
        with pytest.raises(PlanOrderError, match="expected 0"):
            plans.get(1)
        assert plans.get(0) == 0 and plans.get(1) == 1
        with pytest.raises(PlanOrderError):
            plans.get(0)
        assert plans.expects(1) and plans.expects(2) and not plans.expects(0)
        assert plans.get(2) == 2 and plans.next_key is None
        with pytest.raises(PlanOrderError, match="no more keys"):
            plans.get(3)


class _Plan:
    def __init__(self, key):
        self.key = key


def test_at_most_the_current_and_the_next_plan_are_held():
    """After get(k), plans before k are no longer referenced: two plans at most (weak references).
    Would catch a cache that keeps every plan."""
    refs = {}

    def plan(i):
        p = _Plan(i)
        refs[i] = weakref.ref(p)
        return p

    plans = PlanAhead(plan, range(5))
    for i in range(4):
        assert plans.get(i).key == i
    deadline = time.monotonic() + WAIT_S
    while 4 not in refs and time.monotonic() < deadline:
        time.sleep(0.01)
    gc.collect()
    assert [k for k, r in refs.items() if r() is not None] == [3, 4]
    plans.close()
    gc.collect()
    assert all(r() is None for r in refs.values())


def _plan_threads() -> list:
    return [t for t in threading.enumerate() if t.name.startswith("pg-plan-ahead")]


def test_close_waits_for_a_plan_in_flight_and_a_raising_step_leaves_no_thread():
    """A step raises while the next plan is still being built: leaving the ``with`` block waits for
    that plan and no planning thread is left; after close(), get refuses. Would catch a close that
    returns with the thread still running, or a non-daemon thread (a hang at interpreter exit)."""
    release = threading.Event()

    def plan(i):
        if i == 1:
            assert threading.current_thread().daemon
            release.wait(WAIT_S)
        return i

    def finish_later():
        time.sleep(0.1)
        release.set()

    plans = PlanAhead(plan, range(3))
    with pytest.raises(RuntimeError, match="step failed"):
        with plans:
            plans.get(0)
            assert _plan_threads()  # plan 1 in flight
            threading.Thread(target=finish_later, daemon=True).start()
            raise RuntimeError("step failed")
    assert release.is_set() and _plan_threads() == []
    with pytest.raises(PlanOrderError, match="closed"):
        plans.get(1)
    plans.close()  # idempotent


def _feed(steps, plan_ahead, end=None):
    return RolloutFeed(steps, LOSS, PlanConfig(dp_size=2, num_microbatches=2, vocab_size=128), dp_rank=1, cp_rank=0,
                       plan_ahead=plan_ahead, end_iteration=end)


def test_the_feed_with_plan_ahead_yields_the_microbatches_of_the_synchronous_feed():
    """RolloutFeed (Megatron-LM's data iterator), resumed at iteration 3, 7 iterations over 4
    rollout steps: every microbatch and its totals equal the synchronous feed's, the iteration's
    plan asked for again (the per-iteration log) is that iteration's, the start-up check keeps no
    plan, and close() leaves no thread. Would catch plans of the wrong iteration after the cycle
    wraps, or a start-up check that still holds every plan."""
    steps = _steps()
    ahead, sync = _feed(steps, True, end=10), _feed(steps, False)
    assert ahead.problems() == [] and sync.problems() == []
    assert ahead._plans == {} and len(sync._plans) == 4
    per_iteration = len(sync.plan(0).for_rank(1))
    a, s = ahead.microbatches(3), sync.microbatches(3)
    for n in range(7 * per_iteration):
        got, want = next(a), next(s)
        assert got.iteration == want.iteration == 3 + n // per_iteration
        assert_same(got.microbatch, want.microbatch, f"item {n}")
        assert got.totals == want.totals
        if n % per_iteration == per_iteration - 1:  # the iteration ran: its record reads its plan
            assert_same(ahead.plan(got.iteration), sync.plan(got.iteration), f"iteration {got.iteration}")
    assert_same(ahead.plan(1), sync.plan(1))  # out of order: planned now, not from the thread
    ahead.close()
    assert _plan_threads() == []


def test_the_feeds_start_up_check_still_lists_every_bad_step():
    """With plan-ahead the start-up check (every rollout step planned once) is unchanged: a step
    over the vocabulary is listed before any iteration."""
    steps = _steps()
    steps[1] = dataclasses.replace(steps[1], prompt_tokens=steps[1].prompt_tokens.clone())
    steps[1].prompt_tokens[0] = 1000
    problems = _feed(steps, True).problems()
    assert len(problems) == 1 and problems[0].startswith("rollout step 1: rollout 0:"), problems

"""The next plan in the background: while step ``k`` runs, step ``k + 1`` is planned on one host
thread (the planner's torch CPU ops release the GIL), so a step longer than its plan never waits
for the planner.

:class:`PlanAhead` is generic: given ``plan(key)`` and the order of the upcoming keys, it runs
the next key's plan in one background daemon thread and hands the plans out in that order::

    plans = PlanAhead(lambda i: plan_step(steps[i], loss_cfg, plan_cfg), range(start, end))
    try:
        for i in range(start, end):
            plan = plans.get(i)  # waits for plan i (started when plan i - 1 was handed out) ...
            run(plan)            # ... and plan i + 1 is being built meanwhile
    finally:
        plans.close()

Contract:

* **identical results**: each plan is ``plan(key)`` called once with the same argument as the
  synchronous loop would, only on another thread; the planner is deterministic, so the plans are
  equal tensor by tensor (tests/unit/data/test_plan_ahead.py);
* **errors at the step that needs them**: an exception raised by ``plan(key)`` in the background
  is kept, untouched (its type, message and attributes: a rollout file's path and line stay in
  it), and raised by ``get(key)``: not earlier (the steps before it run), never swallowed. After
  a failed plan nothing more is planned ahead;
* **bounded memory**: at most two plans are held, the current one (``get`` of the same key again
  returns it) and the next one;
* **the switch**: ``enabled=False`` starts no thread; ``get`` then plans in the caller's thread
  (the synchronous loop, unchanged);
* **shutdown**: the thread is a daemon (a run never hangs at exit on it) and ends after its one
  plan; :meth:`close` waits for a plan in flight, so no thread outlives the run, also when a step
  raised (``with PlanAhead(...) as plans:`` closes it).

Waiting on a plan is a host wait on a thread, never a device synchronisation. One consumer
thread calls :meth:`get` (the training loop); the class is not meant for concurrent callers.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable, Optional

__all__ = ["PlanAhead", "PlanOrderError"]

_END = object()


class PlanOrderError(RuntimeError):
    """A key requested out of the announced order (a caller's bug, not a data error)."""


class _Job:
    """One key's plan: run inline (:meth:`finish` without :meth:`start`) or on a daemon thread."""

    def __init__(self, key, plan: Callable):
        self.key = key
        """The key this job plans."""
        self._plan = plan
        self.value: Any = None
        """``plan(key)``, once finished without an error."""
        self.error: Optional[BaseException] = None
        """The exception ``plan(key)`` raised, kept as raised (re-raised by ``PlanAhead.get``)."""
        self.plan_s = 0.0
        """Seconds ``plan(key)`` took (wherever it ran)."""
        self.thread: Optional[threading.Thread] = None
        """The background thread; None while not started or when planned inline."""

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self.value = self._plan(self.key)
        except BaseException as err:  # noqa: BLE001 - kept and re-raised where the plan is requested
            self.error = err
        finally:
            self.plan_s = time.perf_counter() - t0
            self._plan = None  # nothing of the caller's kept past the plan

    def start(self, name: str) -> None:
        self.thread = threading.Thread(target=self._run, name=f"{name}-{self.key}", daemon=True)
        self.thread.start()

    def finish(self) -> None:
        """Wait for the background plan, or plan here when none was started."""
        if self.thread is not None:
            self.thread.join()
        elif self._plan is not None:
            self._run()

    def result(self):
        if self.error is not None:
            raise self.error
        return self.value


class PlanAhead:
    """The plans of ``keys``, in that order, each built in the background while the previous one
    is in use (see the module docstring for the contract)."""

    def __init__(self, plan: Callable[[Any], Any], keys: Iterable, *, enabled: bool = True,
                 name: str = "pg-plan-ahead"):
        self.plan = plan
        """``plan(key) -> plan``: called once per handed-out key, in the background when enabled."""
        self.enabled = enabled
        """Plan the next key in the background (False: every plan is built by :meth:`get`, in the
        caller's thread, and no thread is ever started)."""
        self.name = name
        """Prefix of the background threads' names (``{name}-{key}``)."""
        self.waited_s = 0.0
        """Seconds :meth:`get` spent waiting for plans (with ``enabled=False``: planning them): the
        planning time the caller saw, summed over every plan handed out."""
        self.planned_s = 0.0
        """Seconds the plans handed out took to build, summed (wherever they ran)."""
        self.handed_out = 0
        """Plans :meth:`get` handed out (a repeated ``get`` of the current key not counted)."""
        self._keys = iter(keys)
        self._current: Optional[_Job] = None  # the key handed out last: its plan or error
        self._next: Optional[_Job] = None  # the next key in order: started when enabled
        self._closed = False
        self._prepare_next()  # the first key's plan starts now

    # ------------------------------------------------------------------ the caller's side

    @property
    def current_key(self):
        """The key handed out last (None before the first :meth:`get`)."""
        return None if self._current is None else self._current.key

    @property
    def next_key(self):
        """The key :meth:`get` hands out next; None after the last key (or when closed)."""
        if self._next is None and not self._closed:
            self._take_key()
        return None if self._next is None else self._next.key

    def expects(self, key) -> bool:
        """Whether :meth:`get` takes ``key`` now: the current key, or the next one in order."""
        return key == self.current_key or (self.next_key is not None and key == self.next_key)

    def get(self, key):
        """The plan of ``key``: the current key again (kept), or the next key in order (waiting
        for its background plan, then starting the one after it). Raises the plan's own exception
        if building it failed, and :class:`PlanOrderError` for any other key."""
        if self._closed:
            raise PlanOrderError(f"{self.name}: closed; no plan of {key!r}")
        if self._current is not None and self._current.key == key:
            return self._current.result()
        if self.next_key is None or self._next.key != key:
            expected = "no more keys" if self.next_key is None else f"expected {self._next.key!r}"
            raise PlanOrderError(f"{self.name}: plan of {key!r} requested out of order ({expected}; "
                                 f"current {self.current_key!r})")
        job, self._next = self._next, None
        t0 = time.perf_counter()
        job.finish()
        self.waited_s += time.perf_counter() - t0
        self.planned_s += job.plan_s
        self.handed_out += 1
        self._current = job  # the previous plan is dropped here: two plans at most
        if job.error is None:
            self._prepare_next()  # runs while the caller uses this plan
        return job.result()

    def close(self) -> None:
        """Wait for a plan in flight (its result is dropped) and drop every plan. Idempotent;
        :meth:`get` refuses afterwards."""
        self._closed = True
        job, self._next, self._current = self._next, None, None
        if job is not None and job.thread is not None:
            job.thread.join()

    def __enter__(self) -> "PlanAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _take_key(self) -> None:
        key = next(self._keys, _END)
        if key is not _END:
            self._next = _Job(key, self.plan)

    def _prepare_next(self) -> None:
        if self._closed:
            return
        self._take_key()
        if self._next is not None and self.enabled:
            self._next.start(self.name)

"""The fuzzer's launch bookkeeping: cases are cut into bounded launches by world size, and a
launch that dies loses nothing (its rows are kept, the case it died on is a failed row with a
cause, the cases after it run again). The launches are stood in for: what is checked here is the
host's accounting; the real torchrun runs in tests/distributed/test_fuzz.py."""
from __future__ import annotations

import json

from megatron_pg_agg.parity import fuzz
from megatron_pg_agg.parity.fuzz import CASES_PER_LAUNCH, _batches, _launch, _read_rows, draw_case


def _cases_of_world(world: int, n: int) -> list:
    found, seed = [], 0
    while len(found) < n:
        case = draw_case(seed)
        if case.world == world:
            found.append(case)
        seed += 1
    return found


def test_launches_hold_one_world_size_and_at_most_the_bound():
    cases = _cases_of_world(2, CASES_PER_LAUNCH + 3) + _cases_of_world(1, 2)
    batches = _batches(cases)
    assert [(w, len(g)) for w, g in batches] == [(1, 2), (2, CASES_PER_LAUNCH), (2, 3)]
    assert [c.seed for _, g in batches[1:] for c in g] == [c.seed for c in cases[:CASES_PER_LAUNCH + 3]]


def test_a_torn_last_line_is_dropped(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"seed": 1}) + "\n" + '{"seed": 2, "obj')
    assert _read_rows(str(path)) == [{"seed": 1}]
    assert _read_rows(str(tmp_path / "missing.jsonl")) == []


def test_a_dying_launch_keeps_its_rows_names_the_case_and_reruns_the_rest(monkeypatch):
    cases = _cases_of_world(1, 5)
    launched = []

    def fake_launch(world, group, timeout_s, log):
        launched.append([c.seed for c in group])
        if len(launched) == 1:  # the first launch dies on its third case
            return [{"seed": c.seed, "passed": True} for c in group[:2]], "exit code -11", "a\nSIGSEGV\n"
        return [{"seed": c.seed, "passed": True} for c in group], None, ""

    monkeypatch.setattr(fuzz, "_run_launch", fake_launch)
    rows = list(_launch(cases, 60.0, lambda *a: None))
    seeds = [c.seed for c in cases]
    assert launched == [seeds, seeds[3:]]
    assert [r["seed"] for r in rows] == seeds
    dead = rows[2]
    assert dead["passed"] is False and "exit code -11" in dead["error"] and "SIGSEGV" in dead["error"]
    assert all(r["passed"] for i, r in enumerate(rows) if i != 2)


def test_a_launch_that_dies_after_its_last_row_costs_no_case(monkeypatch):
    cases = _cases_of_world(1, 2)
    logged = []
    monkeypatch.setattr(fuzz, "_run_launch", lambda w, g, t, log: ([{"seed": c.seed, "passed": True} for c in g],
                                                                  "exit code 1", ""))
    rows = list(_launch(cases, 60.0, logged.append))
    assert [r["seed"] for r in rows] == [c.seed for c in cases] and all(r["passed"] for r in rows)
    assert any("died after its last case" in line for line in logged)

"""The trainer's metrics file across runs: MetricsLog marks each run, read_runs reads them apart."""
import json

from megatron_pg_agg.training.metrics import MetricsLog, new_run_id, read_runs, run_start_record


def test_runs_resumes_and_older_records_are_read_apart(tmp_path):
    """An older record without an id, a run, a second run, then the first run resumed: read_runs
    gives three runs in order of first appearance, the resumed part joined to its run. Catches a
    record written without the id, a resume read as a new run, or the start records counted as steps."""
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"iteration": 1, "objective": 0.5}) + "\n")  # a file from before run ids
    first, second = new_run_id(), new_run_id()
    assert first != second
    for run_id, start, iters in ((first, 0, 2), (second, 0, 1), (first, 2, 3)):
        log = MetricsLog(str(path), None, iters, enabled=True,
                         run_start=run_start_record(run_id, argv=["train_actor.py"], model="m", start_iteration=start,
                                                    extra={}))
        for it in range(start + 1, iters + 1):
            log.log({"iteration": it, "objective": 0.1 * it})
        log.write({"final": True, "iteration": iters})
        log.close()
    old, a, b = read_runs(str(path))
    assert old.run_id is None and [r["iteration"] for r in old.steps] == [1] and not old.starts
    assert a.run_id == first and [r["iteration"] for r in a.steps] == [1, 2, 3]
    assert [s["start_iteration"] for s in a.starts] == [0, 2] and len(a.finals) == 2
    assert b.run_id == second and [r["iteration"] for r in b.steps] == [1]
    assert all(r["run_id"] == first for r in a.steps + a.finals + a.starts)


def test_a_disabled_log_writes_nothing(tmp_path):
    log = MetricsLog(str(tmp_path / "m.jsonl"), None, 1, enabled=False,
                     run_start=run_start_record("x", argv=[], model="m", start_iteration=0, extra={}))
    log.log({"iteration": 1})
    log.close()
    assert not (tmp_path / "m.jsonl").exists()

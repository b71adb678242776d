"""The tests' forked launches (tests/support/fork_server.py) against a fresh process and a real
torchrun, as the independent reference: the same launcher environment, argv, working directory,
sys.path[0] and exit statuses. Catches a launcher variable missing or wrong in the fork (a
rank's LOCAL_WORLD_SIZE, the agent store), a status torchrun would report otherwise, or a
program run with another argv or path."""
from __future__ import annotations

import json
import sys

import pytest

from megatron_pg_agg.megatron.torchrun import torchrun_command
from tests.support import fork_server
from tests.support.launching import ROOT, child_env, launcher_env, run, start_forked, torchrun, worker

PROBE = ROOT / "tests" / "distributed" / "workers" / "launch_probe.py"
RUN_SPECIFIC = ("MASTER_PORT", "TORCHELASTIC_RUN_ID")  # a fresh value per launch, by design


def _lines(out: str) -> list:
    return sorted((json.loads(line) for line in out.splitlines() if line.startswith("{")),
                  key=lambda row: row["env"]["RANK"] or "")


def _comparable(rows: list) -> list:
    for row in rows:
        row.pop("preloaded")  # how the process started, not what it sees
        for key in RUN_SPECIFIC:
            assert (row["env"][key] is None) == (rows[0]["env"][key] is None)
            row["env"][key] = "-" if row["env"][key] else None
    return rows


@pytest.mark.parametrize("cmd", [
    [sys.executable, str(PROBE), "a", "--b"],
    torchrun(2, *worker("launch_probe"), "x", "--y", 1),
], ids=["script", "torchrun module"])
def test_a_forked_launch_sees_what_a_fresh_one_sees(cmd):
    assert fork_server.plan(cmd) is not None
    rc_fresh, fresh, _ = run(cmd, 120, "fresh probe", fresh=True)
    rc_forked, forked, _ = run(cmd, 120, "forked probe")
    assert rc_fresh == rc_forked == 0, (fresh[-3000:], forked[-3000:])
    expected, got = _comparable(_lines(fresh)), _comparable(_lines(forked))
    assert len(expected) == (2 if "torch.distributed.run" in cmd else 1)
    assert got == expected
    if len(got) == 2:
        assert [row["sum"] for row in got] == [3.0, 3.0]  # the ranks met through the agent store


@pytest.mark.parametrize("exit_as, rank, launch_status", [("3", "1", 1), ("raise", "0", 1)])
def test_a_failing_rank_fails_the_launch_as_torchrun_reports_it(exit_as, rank, launch_status):
    env = child_env(PROBE_EXIT=exit_as, PROBE_EXIT_RANK=rank)
    rc_fresh, fresh, _ = run(torchrun(2, PROBE), 120, "fresh probe", env=env, fresh=True)
    rc_forked, forked, _ = run(torchrun(2, PROBE), 120, "forked probe", env=env)
    assert rc_fresh == rc_forked == launch_status, (fresh[-3000:], forked[-3000:])
    if exit_as == "raise":
        assert "ValueError: the probe raised" in fresh and "ValueError: the probe raised" in forked


@pytest.mark.parametrize("exit_as, status", [("5", 5), ("raise", 1)])
def test_one_process_exits_with_its_programs_status(exit_as, status):
    env = child_env(PROBE_EXIT=exit_as)
    rc_fresh, fresh, _ = run([sys.executable, str(PROBE)], 120, "fresh probe", env=env, fresh=True)
    rc_forked, forked, _ = run([sys.executable, str(PROBE)], 120, "forked probe", env=env)
    assert rc_fresh == rc_forked == status
    assert ("Traceback" in forked) == ("Traceback" in fresh) == (exit_as == "raise")


def test_what_a_fork_cannot_show_starts_fresh():
    """Another interpreter flag or import-time environment, torchrun beyond --standalone, -c: no fork."""
    assert fork_server.plan([sys.executable, "-c", "pass"]) is None
    assert fork_server.plan([sys.executable, "-W", "error", str(PROBE)]) is None
    assert fork_server.plan([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", str(PROBE)]) is None
    assert fork_server.plan(["bash", str(PROBE)]) is None
    assert start_forked([sys.executable, str(PROBE)], env=child_env(PYTHONPATH="/elsewhere")) is None
    plain = child_env()
    plain.pop("PYTHONWARNINGS")
    assert start_forked([sys.executable, str(PROBE)], env=plain) is None


@pytest.mark.parametrize("exit_as, status", [(None, 0), ("3", 1)])
def test_the_packages_own_torchrun_is_forked_under_the_launcher_environment(exit_as, status, monkeypatch):
    """torchrun_command() under launching.launcher_env (how the parity check, the fuzzer and the
    benchmarks start torchrun in the tests) goes through tests/support/fork_client.py: its ranks are
    forks of the preloaded server, and they see and report what a real torchrun's ranks do."""
    extra = {} if exit_as is None else {"PROBE_EXIT": exit_as, "PROBE_EXIT_RANK": "1"}
    env = launcher_env(**extra)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    client = [*torchrun_command(), "--standalone", "--nproc_per_node", "2", *worker("launch_probe"), "x"]
    assert client[1:3] == ["-m", "tests.support.fork_client"], client
    rc_fresh, fresh, _ = run(torchrun(2, *worker("launch_probe"), "x"), 120, "fresh probe", env=child_env(**extra),
                             fresh=True)
    rc_client, through, _ = run(client, 120, "probe through the client", fresh=True, env=env)
    assert rc_fresh == rc_client == status, (fresh[-3000:], through[-3000:])
    rows = _lines(through)
    assert [row["preloaded"] for row in rows] == [True, True] and [row["preloaded"] for row in _lines(fresh)] == [
        False, False]
    assert _comparable(rows) == _comparable(_lines(fresh))

"""The trainer's command line and the main job's (launch/train_actor.py): a run without --rollouts is the
online job, which only the main job's command line passes in; the trainer's own refuses it at start-up,
naming the way, instead of training on nothing. Run in a fresh interpreter: the command line sets the
process's logging and warning filters."""
import subprocess
import sys

from tests.support.launching import ROOT, child_env

CODE = """
from megatron_pg_agg.online import cli as main_job_cli
from megatron_pg_agg.training import cli
seen = []
print("trainer", cli.main(["--train-iters", "1"]))
print("with job", cli.main(["--train-iters", "1", "--group-size", "4"], online_job=lambda cfg: seen.append(cfg) or {}))
print("job got", seen[0].online.group_size, seen[0].online.prompts_per_step, seen[0].data.rollouts)
print("offline", cli.main(["--rollouts", "synthetic", "--group-size", "4"], online_job=seen.append))
assert main_job_cli._online_job.__module__ == "megatron_pg_agg.online.cli"
"""


def test_only_the_main_jobs_command_line_runs_the_online_job():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=child_env())
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[:3] == ["trainer 2", "with job 0", "job got 4 64 None"], out.stdout
    assert "no --rollouts: the online main job runs through launch/train_actor.py" in out.stderr
    # an online flag with --rollouts is refused before any job is chosen (run_config's rule)
    assert lines[3] == "offline 2" and "--group-size only act(s) on the online run" in out.stderr, out.stderr[-2000:]

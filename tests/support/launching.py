"""Start torchrun jobs (or any command) from tests: own session, bounded time, output kept."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_pg_agg.megatron.parallel import free_port  # noqa: F401  (the one copy, re-exported for tests)

ROOT = Path(__file__).resolve().parents[2]




RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
"""torch.distributed's environment: an in-process test that initialised a process group leaves
them set (its port still bound), and a child must never inherit them."""


def child_env(**extra) -> dict:
    inherited = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
    return {**inherited, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra}


def start(cmd, *, env=None, cwd=ROOT) -> subprocess.Popen:
    # own session: on a timeout the whole launch (torchrun and its workers) is killed
    return subprocess.Popen(cmd, cwd=cwd, env=env or child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout_s: float, what: str) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{what} did not finish in {timeout_s}s; output:\n{out[-20000:]}")
    return proc.returncode, out


def _children(pid: int) -> list:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def kill_launch(proc: subprocess.Popen) -> None:
    """SIGKILL a launch as a machine failure would: torchrun's group, and every process left in
    its workers' sessions. torchrun starts each worker in a session of its own, and a worker's
    helpers (Megatron-LM's torch_dist checkpoint writer keeps a multiprocessing Manager per
    worker) outlive a SIGKILLed worker holding its stdout, so a test would wait on them forever."""
    sessions = {proc.pid} | set(_children(proc.pid))
    os.killpg(proc.pid, signal.SIGKILL)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) in sessions:
                    os.kill(int(entry), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def run(cmd, timeout_s: float, what: str, *, env=None) -> tuple[int, str, float]:
    t0 = time.monotonic()
    rc, out = finish(start(cmd, env=env), timeout_s, what)
    return rc, out, time.monotonic() - t0


def worker(name: str) -> list:
    """The arguments that run ``tests/distributed/workers/<name>.py`` as a module (``-m``; after
    ``torchrun(n, ...)`` or ``sys.executable``): from ``ROOT`` (every launch's cwd) the workers
    import the test helpers as the ``tests`` package, with no ``sys.path`` edit."""
    return ["-m", f"tests.distributed.workers.{name}"]


def worker_rows(name: str, nproc: int, out, timeout_s: float):
    """Run worker ``name`` on ``nproc`` ranks with the output path ``out`` as its argument; fail
    the test with the launch's output unless it exits 0; return the JSON it wrote."""
    import json

    rc, log, _ = run(torchrun(nproc, *worker(name), out), timeout_s, name)
    if rc != 0:
        pytest.fail(f"{name} exited {rc}:\n{log[-20000:]}")
    with open(out) as f:
        return json.load(f)


def torchrun(nproc: int, *args) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            *map(str, args)]


def launch_command(nproc: int, program, *args) -> list:
    """One process (``sys.executable``) or a torchrun launch of ``nproc``; ``program`` is a script
    path or ``worker(name)``'s ``-m`` arguments."""
    from pathlib import Path

    program = [str(program)] if isinstance(program, Path) else list(program)
    if nproc == 1:
        return [sys.executable, *program, *map(str, args)]
    return torchrun(nproc, *program, *args)


def split_by_run(out: str) -> dict:
    """A batch launch's output (tests/distributed/workers/megatron_lm_runs.py) cut at its
    ``[runs] NAME`` markers: ``{run name: its lines}``."""
    parts, name = {}, None
    for line in out.splitlines():
        if line.startswith("[runs] "):
            name = line[len("[runs] "):]
            parts[name] = []
        elif name is not None:
            parts[name].append(line)
    return {k: "\n".join(v) for k, v in parts.items()}


"""Start torchrun jobs (or any command) from tests: own session, bounded time, output kept."""
from __future__ import annotations

import atexit
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from megatron_pg_agg.megatron.parallel import free_port  # noqa: F401  (the one copy, re-exported for tests)
from megatron_pg_agg.megatron.torchrun import TORCHRUN_ENV
from tests.support import fork_client, fork_server

ROOT = Path(__file__).resolve().parents[2]




RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
"""torch.distributed's environment: an in-process test that initialised a process group leaves
them set (its port still bound), and a child must never inherit them."""


def child_env(**extra) -> dict:
    inherited = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
    return {**inherited, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra}


def launcher_env(**extra) -> dict:
    """:func:`child_env` for a command that starts torchrun itself (the parity check, the fuzzer, the
    benchmarks): its launches are forked from the session's preloaded interpreter too
    (tests/support/fork_client.py, through ``MEGATRON_PG_AGG_TORCHRUN``), or fresh where the fork
    server is off."""
    return {**child_env(**extra), **forked_torchrun()}


def forked_torchrun() -> dict:
    """The variables that make :func:`megatron_pg_agg.megatron.torchrun.torchrun_command` the fork
    server's client (``{}`` where the server is off)."""
    path = _fork_server()
    if path is None:
        return {}
    return {TORCHRUN_ENV: f"{shlex.quote(sys.executable)} -m tests.support.fork_client", fork_client.SERVER_ENV: path,
            fork_client.IMPORT_ENV: json.dumps(fork_client.import_time_env(_server["env"]))}


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


FRESH_ENV = "MEGATRON_PG_AGG_TEST_FRESH_PROCESSES"
"""Set to ``1`` to start every test launch as a fresh process (no fork server)."""

_server: dict = {}


def _fork_server():
    """The session's fork server (tests/support/fork_server.py): its socket path, or None when
    it is off or did not come up (launches are then fresh)."""
    if os.environ.get(FRESH_ENV) == "1":
        return None
    if "path" not in _server:
        folder = tempfile.mkdtemp(prefix="fork_server_")
        path, log = os.path.join(folder, "socket"), open(os.path.join(folder, "log"), "w")  # noqa: SIM115
        proc = subprocess.Popen([sys.executable, "-m", "tests.support.fork_server", path], cwd=ROOT,
                                env=child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        atexit.register(proc.kill)
        deadline = time.monotonic() + 300
        while not os.path.exists(path) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        _server["env"] = child_env()
        _server["path"] = path if os.path.exists(path) else None
        if _server["path"] is None:
            print(f"fork server did not start (exit {proc.poll()}; {log.name}): fresh processes", file=sys.stderr)
    return _server["path"]


_import_time_env = fork_client.import_time_env


def start_forked(cmd, *, env=None, cwd=ROOT):
    """``cmd`` as a fork of the session's preloaded interpreter (a Popen-like object), or None
    when it cannot be one (another interpreter or flag, another PYTHON*/LD_* environment, a
    torchrun that is not ``--standalone --nproc_per_node N``): tests/support/fork_server.py."""
    planned = fork_server.plan(cmd)
    path = _fork_server() if planned else None
    env = env or child_env()
    if path is None or _import_time_env(env) != _import_time_env(_server["env"]):
        return None
    return fork_server.ForkedLaunch(path, cmd, planned, env, str(cwd))


def run(cmd, timeout_s: float, what: str, *, env=None, fresh: bool = False) -> tuple[int, str, float]:
    """Run ``cmd`` to its end (killed after ``timeout_s``): ``(exit status, output, seconds)``. A
    Python launch is forked from the session's preloaded interpreter where it can be
    (:func:`start_forked`); ``fresh=True`` starts a new process, for what a fork cannot show
    (torchrun's own reports, output while importing)."""
    t0 = time.monotonic()
    proc = None if fresh else start_forked(cmd, env=env)
    rc, out = finish(proc or start(cmd, env=env), timeout_s, what)
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
            parts.setdefault(name, [])  # every rank prints the marker: a later rank's keeps what came before
        elif name is not None:
            parts[name].append(line)
    return {k: "\n".join(v) for k, v in parts.items()}


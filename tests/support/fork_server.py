"""Test launches forked from one preloaded interpreter instead of started fresh.

Why: on 2 CPU cores a test process spends 8-10 s importing torch, megatron-core and this package
before its first line of work (and a torchrun launch pays about 4 s more for its agent, which
imports torch too); the suite launches about a hundred of them per leg. The server here imports
them once; each launch is a fork of it that runs the same program (``python SCRIPT ...`` or
``python -m MODULE ...``) with the launch's argv, environment and working directory, as
``__main__``, through :mod:`runpy`. With ``torch.distributed.run --standalone --nproc_per_node N``
it stands in for torchrun's agent: N forked ranks with torchrun's environment (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_*``,
``MASTER_ADDR``/``MASTER_PORT`` with the agent's TCPStore, ``TORCHELASTIC_USE_AGENT_STORE``,
``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``, ``OMP_NUM_THREADS``), unbuffered output
as torchrun's ``python -u``, and its exit status: 0, or 1 when a rank failed (the others are
then stopped, SIGTERM then SIGKILL).

What a forked launch cannot keep, so :func:`tests.support.launching.run` starts those fresh:
output printed while importing (the start-up noise tests use fresh processes), a different
``PYTHON*``/``LD_*`` environment (import blockers, ``PYTHONWARNINGS``), interpreter flags other
than ``-u``/``-B``, and torchrun's own process tree and reports (kill, hang and exit-report
tests, multi-node launches: :func:`tests.support.launching.start`, ``fresh=True``).

    python -m tests.support.fork_server SOCKET    # the server (launching starts it once per session)
"""
from __future__ import annotations

import array
import gc
import importlib
import io
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import time
import uuid

PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state",
           "megatron.core.models.gpt", "megatron.core.pipeline_parallel", "megatron.core.optimizer",
           "megatron.core.distributed", "megatron_pg_agg.training.trainer", "megatron_pg_agg.parity.workers")
"""What the server imports before its first fork (those that do not import are left to the launch)."""

STOP_GRACE_S = 30.0
"""A failed rank's peers get SIGTERM, then SIGKILL after this long (torchrun's default)."""

FORWARDED_FLAGS = ("-u", "-B")
"""Interpreter flags a forked launch can honour (-u: unbuffered output; -B: no .pyc, moot here)."""


# ----------------------------------------------------------------------------- the launch request
def plan(cmd: list, executable: str = sys.executable):
    """``(flags, nproc, program)`` of a command a forked launch can run, or None: ``[python,
    *flags, SCRIPT.py | -m MODULE, *args]`` (nproc None: one process, no torchrun) or ``[python,
    -m, torch.distributed.run, --standalone, --nproc_per_node, N, SCRIPT.py | -m MODULE, *args]``."""
    cmd = [str(c) for c in cmd]
    if len(cmd) < 2 or cmd[0] != executable:
        return None
    args, flags, nproc = cmd[1:], [], None
    while args and args[0] in FORWARDED_FLAGS:
        flags.append(args.pop(0))
    if args[:2] == ["-m", "torch.distributed.run"]:
        rest = args[2:]
        if rest[:2] != ["--standalone", "--nproc_per_node"] or len(rest) < 4 or not rest[2].isdigit():
            return None
        nproc, args, flags = int(rest[2]), rest[3:], [*flags, "-u"]  # torchrun runs ``python -u``
    if len(args) >= 2 and args[0] == "-m" and not args[1].startswith("-"):
        return flags, nproc, args
    if args and args[0].endswith(".py"):
        return flags, nproc, args
    return None


def _send(sock: socket.socket, message: dict, fds=()) -> None:
    data = json.dumps(message).encode()
    sock.sendmsg([len(data).to_bytes(4, "big"), data],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else [])


def _receive(sock: socket.socket) -> tuple[dict, list]:
    head, ancillary, _, _ = sock.recvmsg(4, socket.CMSG_SPACE(4 * array.array("i").itemsize))
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    size, body = int.from_bytes(head, "big"), b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            raise ConnectionError("the request was cut short")
        body += chunk
    return json.loads(body), list(fds)


# ----------------------------------------------------------------------------- inside a launch
def _stdio(unbuffered: bool) -> None:
    """Fresh ``sys.stdout``/``sys.stderr`` on fds 1 and 2, buffered as a new interpreter's."""
    def stream(fd, **kw):
        raw = io.FileIO(fd, "w", closefd=False)
        return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding="utf-8", **kw)

    sys.stdout = sys.__stdout__ = stream(1, write_through=unbuffered)
    sys.stderr = sys.__stderr__ = stream(2, errors="backslashreplace", line_buffering=True)


def _run_program(flags: list, program: list) -> None:
    """Run ``program`` as ``__main__`` in this process; its SystemExit or exception propagates to
    the interpreter's top level, which exits with its status (atexit handlers run, as in a fresh
    process)."""
    _stdio("-u" in flags)
    if program[0] == "-m":
        sys.argv = ["-m", *program[2:]]  # runpy puts the module's file at argv[0]
        sys.path[0] = os.getcwd()
        runpy.run_module(program[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(program)
        sys.path[0] = os.path.dirname(os.path.abspath(program[0]))
        runpy.run_path(program[0], run_name="__main__")


def _agent(nproc: int, flags: list, program: list) -> int:
    """torchrun's part: fork ``nproc`` ranks with its environment, host the agent store, wait;
    on a rank's failure stop the others. Returns 0, or 1 when a rank failed."""
    # here, not at the top: tests/support/fork_client.py imports this module and no torch
    from torch.distributed import TCPStore  # noqa: PLC0415

    from megatron_pg_agg.megatron.parallel import free_port  # noqa: PLC0415

    port, run_id = free_port(), uuid.uuid4().hex[:12]
    ranks = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            os.environ.update({
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
                "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc), "ROLE_NAME": "default",
                "MASTER_ADDR": "localhost", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
            _run_program(flags, program)
            sys.exit(0)  # the program returned without SystemExit
        ranks[pid] = rank
    # the agent store, after the forks: its server runs on a thread, and a fork copies no thread
    store = TCPStore("localhost", port, is_master=True, wait_for_workers=False)  # noqa: F841 (kept alive)
    failed, deadline = False, None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG) if deadline else os.waitpid(-1, 0)
        if pid == 0:
            if time.monotonic() > deadline:
                for other in ranks:
                    os.kill(other, signal.SIGKILL)
                deadline = None
            else:
                time.sleep(0.05)
            continue
        rank, code = ranks.pop(pid), os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = True
            os.write(2, f"[fork_server] rank {rank} exited with {code}: stopping the other ranks\n".encode())
            for other in ranks:
                os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
    return 1 if failed else 0


def _launch(request: dict, out_fd: int) -> None:
    """The forked launch: its own session, the request's output pipe, directory and environment."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    os.close(devnull)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if request["nproc"] is None:
        _run_program(request["flags"], request["program"])
        sys.exit(0)
    code = _agent(request["nproc"], request["flags"], request["program"])
    os._exit(code)


# ----------------------------------------------------------------------------- the server
def _preload() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # Out of the collector's sight: a fork's collections and exit then leave these pages shared
    # (without it a forked process spends 2 s at exit copying the heap it only decrefs).
    gc.collect()
    gc.freeze()


def serve(path: str) -> None:
    """Import :data:`PRELOAD`, listen on the UNIX socket ``path``; each connection is one launch:
    the request and the write end of its output pipe in, the launch's pid out, then (when it
    ends) its exit status. No try/finally here: a forked launch unwinds through this frame."""
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the client waits for the path: it appears listening
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    waiting = {}  # launch pid -> its connection
    while True:
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                request, fds = _receive(conn)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    selector.close()
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    for other in (listener, conn, *waiting.values()):
                        other.close()
                    _launch(request, fds[0])
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"{pid}\n".encode())
                waiting[pid] = conn
            else:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
        while waiting:  # reap every launch that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()


# ----------------------------------------------------------------------------- the client
class ForkedLaunch:
    """The parts of :class:`subprocess.Popen` the tests use (``pid``, ``args``, ``returncode``,
    ``poll``, ``communicate``) for a launch the server forked."""

    def __init__(self, socket_path: str, cmd: list, planned: tuple, env: dict, cwd: str):
        flags, nproc, program = planned
        self.args = cmd
        self.returncode = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(socket_path)
        read_fd, write_fd = os.pipe()
        _send(self._sock, {"flags": flags, "nproc": nproc, "program": program, "env": env, "cwd": str(cwd)},
              [write_fd])
        os.close(write_fd)
        self._out = os.fdopen(read_fd, "rb")
        self._chunks, self._status_text = [], b""
        self.pid = int(self._readline())

    def _readline(self) -> bytes:
        while b"\n" not in self._status_text:
            chunk = self._sock.recv(64)
            if not chunk:
                raise ConnectionError("the fork server closed the launch's connection")
            self._status_text += chunk
        line, self._status_text = self._status_text.split(b"\n", 1)
        return line

    def poll(self):
        if self.returncode is None:
            self._sock.setblocking(False)
            try:
                self.returncode = int(self._readline())
            except (BlockingIOError, ConnectionError):
                pass
            finally:
                self._sock.setblocking(True)
        return self.returncode

    def relay(self, fd: int) -> int:
        """Copy the launch's output to ``fd`` as it comes, then return its exit status."""
        while True:
            chunk = os.read(self._out.fileno(), 65536)
            if not chunk:
                break
            os.write(fd, chunk)
        self._out.close()
        self.communicate()
        return self.returncode

    def communicate(self, timeout=None):
        """Read the output to its end and wait for the status; subprocess.TimeoutExpired after
        ``timeout`` seconds (call again after killing the launch's group to collect)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        selector = selectors.DefaultSelector()
        if not self._out.closed:
            selector.register(self._out, selectors.EVENT_READ)
        if self.returncode is None:
            selector.register(self._sock, selectors.EVENT_READ)
        while selector.get_map():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                selector.close()
                raise subprocess.TimeoutExpired(self.args, timeout)
            for key, _ in selector.select(left):
                if key.fileobj is self._out:
                    chunk = os.read(self._out.fileno(), 65536)
                    if chunk:
                        self._chunks.append(chunk)
                    else:
                        selector.unregister(self._out)
                        self._out.close()
                else:
                    chunk = self._sock.recv(64)
                    self._status_text += chunk
                    if b"\n" in self._status_text or not chunk:
                        selector.unregister(self._sock)
                        line = self._status_text.split(b"\n", 1)[0]
                        self.returncode = int(line) if line else -signal.SIGKILL
                        self._sock.close()
        selector.close()
        return b"".join(self._chunks).decode("utf-8", "replace"), None


if __name__ == "__main__":
    serve(sys.argv[1])

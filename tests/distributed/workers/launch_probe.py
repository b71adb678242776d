"""What a launched program sees (tests/distributed/test_fork_server.py): one JSON line per rank
with its launcher's environment, argv, working directory and sys.path[0] (and whether megatron-core
was imported before it started: true only in a fork of the preloaded server); a two-rank sum through
gloo; then the exit status ``PROBE_EXIT`` asks of ``PROBE_EXIT_RANK`` (``raise``: an exception)."""
import json
import os
import sys

import torch
import torch.distributed as dist

PRELOADED = "megatron.core" in sys.modules  # torch does not import it: only the fork server's preload has

LAUNCHER = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
            "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
            "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS")

total = None
if "RANK" in os.environ:
    dist.init_process_group("gloo")
    value = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(value)
    total = float(value)
    dist.destroy_process_group()
line = json.dumps({"env": {k: os.environ.get(k) for k in LAUNCHER}, "argv": sys.argv[1:], "cwd": os.getcwd(),
                   "path0": sys.path[0], "sum": total, "main": __name__, "preloaded": PRELOADED})
os.write(1, (line + "\n").encode())  # one write: the ranks' lines never interleave
if os.environ.get("PROBE_EXIT_RANK", os.environ.get("RANK", "0")) == os.environ.get("RANK", "0"):
    if os.environ.get("PROBE_EXIT") == "raise":
        raise ValueError("the probe raised")
    if os.environ.get("PROBE_EXIT"):
        sys.exit(int(os.environ["PROBE_EXIT"]))

"""A small mutation tester: does the unit suite notice a plausible one-token bug?

    python -m tests.support.mutate [--sample N] [--seed S] [--out survivors.json] [FILE ...]

Each mutant changes one token of one source line (a comparison, an arithmetic or boolean
operator, min/max, True/False, an integer constant off by one), found with ``tokenize`` so
strings, comments and docstrings are never touched. The mutant is written over the file in a
scratch copy of the repository, and the unit tests of that layer run there (``-x``, in-process
only) with the copy first on ``PYTHONPATH``; a mutant the tests pass is a survivor. The original
checkout is never modified. Slow by nature (one pytest run per mutant): ``--sample`` draws a
fixed-seed subset.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

DEFAULT_FILES = (
    "megatron_pg_agg/core/aggregation.py", "megatron_pg_agg/core/losses.py", "megatron_pg_agg/core/token_layout.py",
    "megatron_pg_agg/core/rollout_correction.py",
    "megatron_pg_agg/data/planner.py", "megatron_pg_agg/data/rollouts.py", "megatron_pg_agg/data/rollout_files.py",
    "megatron_pg_agg/training/run_config.py",
)
TESTS_OF = {  # the unit tests that exercise each layer
    "core": ["tests/unit/core", "tests/unit/data"],
    "data": ["tests/unit/data", "tests/unit/core"],
    "training": ["tests/unit/training"],
}
SWAPS = {"<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "==", "+": "-", "-": "+", "*": "/",
         "/": "*", "//": "/", "and": "or", "or": "and", "min": "max", "max": "min", "True": "False",
         "False": "True", "&": "|", "|": "&"}


def mutants(path: Path) -> list:
    """``(line, col, old, new)`` for every mutable token of ``path`` outside strings and comments."""
    found = []
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    previous = None
    for tok in tokens:
        text = tok.string
        if tok.type in (tokenize.OP, tokenize.NAME) and text in SWAPS:
            if text in ("-", "*") and previous is not None and previous.string in ("(", ",", "=", "[", "return"):
                previous = tok
                continue  # a unary minus or a star-argument: not an arithmetic slip
            found.append((tok.start[0], tok.start[1], text, SWAPS[text]))
        elif tok.type == tokenize.NUMBER and text.isdigit():
            found.append((tok.start[0], tok.start[1], text, str(int(text) + 1)))
        previous = tok
    return found


def _apply(source: str, line: int, col: int, old: str, new: str) -> str:
    lines = source.splitlines(keepends=True)
    text = lines[line - 1]
    assert text[col:col + len(old)] == old, (line, col, old, text)
    lines[line - 1] = text[:col] + new + text[col + len(old):]
    return "".join(lines)


def _scratch_copy() -> Path:
    scratch = Path(tempfile.mkdtemp(prefix="mutate-"))
    # tracked files and new ones not yet committed (a test just written must count)
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file():
            (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, scratch / rel)
    return scratch


def run_tests(scratch: Path, tests: list, timeout_s: float) -> str:
    """'killed' (a test failed or errored), 'survived', or 'timeout' (counted as killed)."""
    env = {**os.environ, "PYTHONPATH": str(scratch), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "not dist", *tests]
    try:
        proc = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "timeout"
    return "survived" if proc.returncode == 0 else "killed"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.mutate", description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", default=list(DEFAULT_FILES))
    parser.add_argument("--sample", type=int, default=None, help="mutants to draw (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant's test run")
    parser.add_argument("--out", default=None, help="write every result here (JSON)")
    args = parser.parse_args(argv)
    pool = [(f, *m) for f in args.files for m in mutants(ROOT / f)]
    chosen = sorted(random.Random(args.seed).sample(pool, min(args.sample, len(pool)))) if args.sample else pool
    print(f"[mutate] {len(chosen)} of {len(pool)} mutants in {len(args.files)} files", flush=True)
    scratch = _scratch_copy()
    results = []
    try:
        for k, (rel, line, col, old, new) in enumerate(chosen, 1):
            original = (scratch / rel).read_text()  # the copy: edits to the checkout meanwhile cannot leak in
            (scratch / rel).write_text(_apply(original, line, col, old, new))
            t0 = time.monotonic()
            outcome = run_tests(scratch, TESTS_OF[rel.split("/")[1]], args.timeout)
            (scratch / rel).write_text(original)
            code = original.splitlines()[line - 1].strip()
            results.append({"file": rel, "line": line, "old": old, "new": new, "code": code, "outcome": outcome})
            took = time.monotonic() - t0
            print(f"[mutate] {k}/{len(chosen)} {outcome:8s} {rel}:{line} {old!r}->{new!r} ({took:.0f}s)  {code[:90]}",
                  flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    survivors = [r for r in results if r["outcome"] == "survived"]
    print(f"[mutate] {len(survivors)} of {len(results)} survived", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

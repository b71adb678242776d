"""The layout fuzzer in CI: 20 random cases per full leg against the float64 reference (40 per
.ci/run: its two full legs draw different cases), a new seed per commit.

The seed is ``MEGATRON_PG_AGG_FUZZ_SEED`` when set, else drawn from the checkout's commit and the
installed megatron-core (so each commit and each leg fuzz new cases, and a failure reruns with the
same seed); it is printed, and every failing case prints its one-line rerun command
(``python -m megatron_pg_agg.parity --fuzz-case SEED``).
"""
import hashlib
import os
import re
import subprocess
import sys

from tests.support.launching import ROOT, launcher_env

CASES = 20


def _seed() -> int:
    if os.environ.get("MEGATRON_PG_AGG_FUZZ_SEED"):
        return int(os.environ["MEGATRON_PG_AGG_FUZZ_SEED"])
    from megatron_pg_agg.versions import installed_megatron_core_version

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    key = f"{head or 'no-git'}/{installed_megatron_core_version()}"
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)


def test_random_cases_match_the_reference(tmp_path):
    seed = _seed()
    print(f"fuzz seed {seed} (rerun: python -m megatron_pg_agg.parity --fuzz {CASES} --seed {seed})")
    proc = subprocess.run([sys.executable, "-m", "megatron_pg_agg.parity", "--fuzz", str(CASES), "--seed", str(seed),
                           "--json", str(tmp_path / "fuzz.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500, env=launcher_env())
    lines = proc.stdout.strip().splitlines()
    print("\n".join(line for line in lines if line.startswith(("ok", "FAIL", "     rerun", "[fuzz] failed"))))
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-20000:]
    assert lines[-1] == f"fuzz: {CASES}/{CASES} cases passed (seed {seed})", lines[-5:]
    rows = [line for line in lines if re.match(r"(ok|FAIL) ", line)]
    assert len(rows) == CASES and all(line.startswith("ok") for line in rows)

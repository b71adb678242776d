"""Start-up noise: exactly megatron-core's known CPU-fallback warnings are silenced (by message and
category), the entry points say in one line which fallbacks are in use, and nothing else is hidden."""
import subprocess
import sys
import warnings

from tests.support.launching import ROOT, child_env

from megatron_pg_agg.worker_process import quiet_cpu_fallbacks


def test_only_the_known_fallback_warnings_are_silenced(capsys):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_cpu_fallbacks("[test]")
        warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning)
        warnings.warn("Apex is not installed. Falling back to Torch Norm", DeprecationWarning)  # other category
        warnings.warn("something else entirely", UserWarning)
    assert [(w.category, str(w.message)) for w in seen] == [
        (DeprecationWarning, "Apex is not installed. Falling back to Torch Norm"),
        (UserWarning, "something else entirely")]
    assert "no Transformer Engine or apex" in capsys.readouterr().err


def test_the_trainers_first_lines_are_useful():
    """A refused start imports megatron-core (the warnings fire) and prints its reason: no
    fallback warning appears, the one-line summary does, then the refusal."""
    env = child_env()
    env.pop("PYTHONWARNINGS")  # every warning shows, as for a user
    out = subprocess.run([sys.executable, str(ROOT / "launch" / "train_actor.py"), "--train-iters", "0"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("[train] no Transformer Engine or apex"), lines[:5]
    assert "Falling back" not in out.stderr and "warnings.warn" not in out.stderr, out.stderr[-3000:]
    assert any("--train-iters must be >= 1" in line for line in lines)

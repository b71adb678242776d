"""Start-up noise: exactly the known messages of the installed release are silenced (warnings by
message and category, log records by logger and message), the entry points say in one line which
fallbacks are in use, and nothing else is hidden: a real run of each entry prints no warning."""
import logging
import subprocess
import sys
import warnings

from megatron_pg_agg.training.logs import setup_logging
from megatron_pg_agg.training.worker_process import KNOWN_NOISE, active_noise, quiet_startup_noise
from megatron_pg_agg.versions import installed_megatron_core_version
from tests.support.launching import ROOT, child_env

WARNING_WORDS = ("Warning:", "WARNING", "DEPRECATED", "warnings.warn")


def test_only_the_known_messages_of_this_release_are_silenced(capsys):
    installed = installed_megatron_core_version()
    active = active_noise(installed, te=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        setup_logging("[test]")
        quiet_startup_noise()
        warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning, stacklevel=1)
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
                      UserWarning, stacklevel=1)
        # the same message in another category
        warnings.warn("Apex is not installed. Falling back to Torch Norm", DeprecationWarning, stacklevel=1)
        warnings.warn("something else entirely", UserWarning, stacklevel=1)
        # torch's, at the distributed optimizer's first reduce-scatter and all-gather (silenced on every release)
        warnings.warn("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
                      "`torch.distributed.reduce_scatter_single` instead.", FutureWarning, stacklevel=1)
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
                      "`torch.distributed.all_gather_single` instead.", FutureWarning, stacklevel=1)
    assert [(w.category, str(w.message)) for w in seen] == [
        (DeprecationWarning, "Apex is not installed. Falling back to Torch Norm"),
        (UserWarning, "something else entirely")]
    assert "[test] no Transformer Engine or apex" in capsys.readouterr().err
    for noise in (n for n in active if n.category is None):
        logger = logging.getLogger(noise.logger)
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logger.addHandler(handler)
        try:
            logger.warning("%s", noise.message.replace("\\", ""))  # the message itself: dropped
            logger.warning("another message on the same logger")  # kept
        finally:
            logger.removeHandler(handler)
        assert [r.getMessage() for r in records] == ["another message on the same logger"], noise.logger


def test_each_message_is_silenced_only_on_the_releases_that_emit_it():
    """Catches a filter that hides a message on releases where it was never seen (or never on
    the one that emits it), and a TE fallback notice hidden where TE is installed."""
    gpt = next(n for n in KNOWN_NOISE if n.message.startswith("GPTModel IS DEPRECATED"))
    assert gpt in active_noise("0.19.2", te=False) and gpt in active_noise("0.19.2", te=True)
    assert gpt not in active_noise("0.16.1", te=False)
    mempool = next(n for n in KNOWN_NOISE if n.message.startswith("Failed to create unified"))
    assert mempool in active_noise("0.15.3", te=False) and mempool not in active_noise("0.19.2", te=False)
    fallback = [n for n in KNOWN_NOISE if n.cpu_fallback]
    assert fallback and not set(fallback) & set(active_noise("0.16.1", te=True))
    assert all(n.releases is None for n in active_noise(None, te=False))


def _shows_no_warning(stderr: str) -> None:
    bad = [line for line in stderr.splitlines() if any(w in line for w in WARNING_WORDS)]
    assert not bad, bad[:10]


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


def test_a_training_run_prints_no_warning_on_this_release(tmp_path):
    """The main job, one process, one step (model, optimizer, schedule, checkpoint): nothing that
    reads as a warning, on whichever supported release is installed."""
    env = child_env()
    env.pop("PYTHONWARNINGS")
    out = subprocess.run([sys.executable, str(ROOT / "launch" / "train_actor.py"), "--rollouts", "synthetic",
                          "--train-iters", "1",
                          "--metrics-file", str(tmp_path / "m.jsonl")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[train] done: 1 iterations" in out.stderr, out.stderr[-3000:]
    _shows_no_warning(out.stderr)


def test_the_parity_commands_help_is_its_usage_alone():
    """``python -m megatron_pg_agg.parity --help`` (a fresh interpreter, every warning on): the
    usage text and nothing from megatron-core before it (the package imports megatron-core only
    after the command has set the filters). Catches a module-level import of megatron-core in
    the parity package's __init__ again."""
    env = child_env()
    env.pop("PYTHONWARNINGS")
    out = subprocess.run([sys.executable, "-m", "megatron_pg_agg.parity", "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("usage: megatron-pg-agg-parity"), out.stdout[:500]
    assert out.stderr.strip() == "", out.stderr[-3000:]

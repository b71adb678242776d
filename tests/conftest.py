"""Shared fixtures and the ``dist`` marker.

Layout: ``tests/unit`` (in-process, fast: ``pytest -m "not dist" tests``), ``tests/distributed``
(every test there launches processes: torchrun jobs, the trainer, Megatron-LM; marked ``dist``
automatically), ``tests/distributed/workers`` (what those launches run, as
``-m tests.distributed.workers.X``) and ``tests/support`` (helpers, imported as
``tests.support.X``)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIST = ROOT / "tests" / "distributed"  # not "dist": pytest skips folders named dist by default (norecursedirs)
REQUIRE_MEGATRON_LM = "MEGATRON_PG_AGG_REQUIRE_MEGATRON_LM"


def pytest_configure(config):
    config.addinivalue_line("markers", "dist: launches processes (torchrun, the trainer, Megatron-LM); "
                                       "every test under tests/distributed")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if DIST in Path(item.path).parents:
            item.add_marker(pytest.mark.dist)


def find_megatron_lm():
    """``$MEGATRON_LM_PATH``, else ``../shared/third_party/Megatron-LM``; None without a checkout."""
    path = Path(os.environ.get("MEGATRON_LM_PATH") or ROOT.parent / "shared" / "third_party" / "Megatron-LM")
    return path if (path / "megatron" / "training").is_dir() else None


@pytest.fixture(scope="session")
def megatron_lm_checkout() -> Path:
    """The Megatron-LM checkout the integration tests use. Without one they skip with the reason
    (a user's machine); with MEGATRON_PG_AGG_REQUIRE_MEGATRON_LM=1 (.ci/run) that is a failure."""
    found = find_megatron_lm()
    if found is None:
        reason = ("no Megatron-LM checkout: set MEGATRON_LM_PATH or place one at "
                  "../shared/third_party/Megatron-LM")
        if os.environ.get(REQUIRE_MEGATRON_LM) == "1":
            pytest.fail(f"{REQUIRE_MEGATRON_LM}=1 but {reason}")
        pytest.skip(reason)
    return found


@pytest.fixture
def megatron_lm_on_path(megatron_lm_checkout, monkeypatch):
    """The checkout first on ``sys.path`` for an in-process test (restored afterwards)."""
    monkeypatch.setattr(sys, "path", [str(megatron_lm_checkout), *sys.path])
    return megatron_lm_checkout

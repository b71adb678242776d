"""Shared fixtures and the ``dist`` and ``optional_stack`` markers.

Layout: ``tests/unit`` (in-process, fast: ``pytest -m "not dist" tests``), ``tests/distributed``
(every test there launches processes: torchrun jobs, the trainer, Megatron-LM; marked ``dist``
automatically), ``tests/distributed/workers`` (what those launches run, as
``-m tests.distributed.workers.X``) and ``tests/support`` (helpers, imported as
``tests.support.X``). Tests that need Megatron-Bridge or verl carry ``optional_stack``: .ci/run
runs the rest before it installs them (their imports slow every Megatron-LM process), then these."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.support.optional import REQUIRE_MEGATRON_LM, require

ROOT = Path(__file__).resolve().parents[1]
DIST = ROOT / "tests" / "distributed"  # not "dist": pytest skips folders named dist by default (norecursedirs)


def pytest_configure(config):
    config.addinivalue_line("markers", "dist: launches processes (torchrun, the trainer, Megatron-LM); "
                                       "every test under tests/distributed")
    config.addinivalue_line("markers", "optional_stack: needs Megatron-Bridge or verl installed (the bridge / "
                                       "verl extras); .ci/run runs these after installing them, the rest before")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if DIST in Path(item.path).parents:
            item.add_marker(pytest.mark.dist)


THIRD_PARTY = ROOT.parent / "shared" / "third_party"


def _installed_minor():
    from megatron_pg_agg.versions import installed_megatron_core_version

    major, minor = installed_megatron_core_version().split(".")[:2]
    return major, minor


def find_megatron_lm():
    """``$MEGATRON_LM_PATH``, else the training side in ``../shared/third_party`` of the installed
    megatron-core's release (the tested-versions table, ``versions.TESTED``, names the folder);
    None without a checkout."""
    from megatron_pg_agg.versions import TESTED

    path = os.environ.get("MEGATRON_LM_PATH")
    if not path:
        major, minor = _installed_minor()
        folders = [leg.checkout for leg in TESTED if leg.megatron_core.split(".")[:2] == [major, minor]]
        path = THIRD_PARTY / (folders[0] if folders else "Megatron-LM")
    path = Path(path)
    return path if (path / "megatron" / "training").is_dir() else None


def _missing(reason: str):
    """Skip with ``reason`` on a user's machine; fail under MEGATRON_PG_AGG_REQUIRE_MEGATRON_LM=1."""
    require(reason, REQUIRE_MEGATRON_LM)


@pytest.fixture(scope="session")
def megatron_lm_checkout() -> Path:
    """The Megatron-LM checkout the integration tests use. Without one they skip with the reason
    (a user's machine); with MEGATRON_PG_AGG_REQUIRE_MEGATRON_LM=1 (.ci/run) that is a failure."""
    found = find_megatron_lm()
    if found is None:
        _missing("no Megatron-LM checkout: set MEGATRON_LM_PATH or place the training side of the installed "
                 "megatron-core's release in ../shared/third_party (see versions.TESTED)")
    return found


@pytest.fixture(scope="session")
def third_party_checkouts() -> dict:
    """``{folder: path}`` of every training side the tested-versions table names."""
    from megatron_pg_agg.versions import TESTED

    found = {leg.checkout: THIRD_PARTY / leg.checkout for leg in TESTED}
    absent = [name for name, path in found.items() if not (path / "megatron" / "training").is_dir()]
    if absent:
        _missing(f"training sides missing from {THIRD_PARTY}: {absent}")
    return found


@pytest.fixture
def megatron_lm_on_path(megatron_lm_checkout, monkeypatch):
    """The checkout first on ``sys.path`` for an in-process test (restored afterwards)."""
    monkeypatch.setattr(sys, "path", [str(megatron_lm_checkout), *sys.path])
    return megatron_lm_checkout

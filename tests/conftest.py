"""Shared fixtures."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIRE_MEGATRON_LM = "MEGATRON_PG_AGG_REQUIRE_MEGATRON_LM"


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

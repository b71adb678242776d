"""Optional stacks in the tests (a Megatron-LM checkout, Megatron-Bridge, verl, AReaL): a test that needs
one skips with the reason on a user's machine, and fails instead where CI sets the stack's
``MEGATRON_PG_AGG_REQUIRE_*=1`` (.ci/run installs it there)."""
from __future__ import annotations

import os
from typing import Optional

import pytest

REQUIRE_MEGATRON_LM = "MEGATRON_PG_AGG_REQUIRE_MEGATRON_LM"
REQUIRE_BRIDGE = "MEGATRON_PG_AGG_REQUIRE_BRIDGE"
REQUIRE_VERL = "MEGATRON_PG_AGG_REQUIRE_VERL"
REQUIRE_AREAL = "MEGATRON_PG_AGG_REQUIRE_AREAL"


def require(problem: Optional[str], env: str) -> None:
    """Return when ``problem`` is None; else skip with it, or fail under ``env=1``."""
    if problem is None:
        return
    if os.environ.get(env) == "1":
        pytest.fail(f"{env}=1 but {problem}")
    pytest.skip(problem)

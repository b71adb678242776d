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
REQUIRE_NEMO_RL = "MEGATRON_PG_AGG_REQUIRE_NEMO_RL"


def require(problem: Optional[str], env: str) -> None:
    """Return when ``problem`` is None; else skip with it, or fail under ``env=1``."""
    if problem is None:
        return
    if os.environ.get(env) == "1":
        pytest.fail(f"{env}=1 but {problem}")
    pytest.skip(problem)


def require_nemo_rl() -> str:
    """The NeMo-RL checkout of ``MEGATRON_PG_AGG_NEMO_RL``, put on ``sys.path``, when it and its Python
    stack (docs/nemo-rl.md) import; else skip, or fail under ``MEGATRON_PG_AGG_REQUIRE_NEMO_RL=1``."""
    import sys

    from megatron_pg_agg.integrations.nemo_rl.plugin import CHECKOUT_ENV, checkout_problem

    path = os.environ.get(CHECKOUT_ENV)
    require(checkout_problem(path), REQUIRE_NEMO_RL)
    path = os.path.abspath(path)
    if path not in sys.path:
        sys.path.insert(0, path)
    try:
        import nemo_rl.algorithms.loss.loss_functions  # noqa: F401
    except ImportError as error:
        require(f"NeMo-RL's loss does not import here ({error}): install its stack (docs/nemo-rl.md)",
                REQUIRE_NEMO_RL)
    return path

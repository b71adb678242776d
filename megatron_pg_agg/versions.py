"""The one place the package's version and the supported Megatron releases are written (setup.py and
.ci/run read this file).

megatron-core 0.15.x to 0.19.x are supported, each with the Megatron-LM training side of the same
minor release (tags ``core_v0.15.x`` ... ``core_v0.19.x``). Every runtime patch checks the installed
release against :data:`SUPPORTED_MEGATRON_CORE` before touching anything (a patch target that
exists only in some releases names its own range), the trainer refuses to start outside it, and
pip installs inside it. Widen it only after the patches' targets and the loss contract (3-tuple,
``calculate_per_token_loss``, ``finalize_model_grads``' count) have been re-verified against the
new release, and a row of :data:`TESTED` runs it in CI.

Older releases are refused with :data:`OLDER_RELEASES_REFUSED` (never overridable). A release
newer than the range is refused too, unless :data:`ALLOW_UNTESTED_ENV` is ``1``: then it warns
once and runs with the targets of the newest tested release.

This module imports nothing at its top (``python megatron_pg_agg/versions.py`` prints the CI
legs before anything is installed).
"""
from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass

PACKAGE_VERSION = "0.1.0"
"""This package's version: setup.py's ``version``, ``megatron_pg_agg.__version__`` and the version a run
records (``training.metrics``, which may import this module and not the package root)."""

SUPPORTED_MEGATRON_CORE = ">=0.15.0,<0.20"
"""PEP 440 specifier set of the megatron-core releases the project supports."""

TORCH_REQUIREMENT = "torch>=2.6.0"
"""What every supported megatron-core release asks of torch (its ``Requires-Dist``); the CPU pin
of a tested leg is in :data:`TESTED` (and the README's commands), never in ``install_requires``."""

ALLOW_UNTESTED_ENV = "MEGATRON_PG_AGG_ALLOW_UNTESTED_MEGATRON"
"""Set to ``1`` to run a megatron-core (and Megatron-LM checkout) NEWER than the supported range,
with a warning instead of the refusal. Older releases are refused whatever it says."""

OLDER_RELEASES_REFUSED = (
    "releases before 0.15 are not supported: the patches were verified on 0.15-0.19 only, and the "
    "older ones differ at their targets (0.13 names the router's loss hook apply_load_balancing_loss "
    "and lacks tensor_parallel.random.force_reset_rng; 0.14's finalize_model_grads takes "
    "grad_finalize_pgs where 0.15+ take pg_collection). Install megatron-core 0.15.x to 0.19.x."
)
"""Why megatron-core 0.13 and 0.14 are refused (never overridable)."""


@dataclass(frozen=True)
class TestedRelease:
    """One row of the tested-versions table: a CI leg (README table and .ci/run come from here)."""

    megatron_core: str
    """The megatron-core release pip installs (``megatron-core==X``)."""
    megatron_lm_tag: str
    """The Megatron-LM tag of the training side the leg runs against."""
    checkout: str
    """That training side's folder in ``../shared/third_party``."""
    python: str
    """``3.11`` (the default ``python3``), ``3.12`` (pyenv's 3.12.1) or ``3.13`` (pyenv's 3.13.0: NeMo-RL)."""
    torch: str
    """The torch release the leg installs (2.13.0: the CPU wheel; 2.14.1: a CUDA build that runs on CPU)."""
    suite: str
    """``full``: every test (the README's test command); ``unit+megatron-lm``: tests/unit plus the
    Megatron-LM tests; ``nemo-rl``: the NeMo-RL plug-in's tests, in NeMo-RL's own stack."""
    megatron_bridge: str | None = None
    """The megatron-bridge release the leg also installs (``--no-deps``, then the ``bridge``
    extra) and whose tests must run there (--hf-model, --save-hf); None: not installed."""
    verl: str | None = None
    """The verl release the leg also installs (``--no-deps``, then the ``verl`` extra) and whose
    plug-in tests must run there (tests/distributed/test_verl.py); None: not installed."""
    areal: str | None = None
    """The AReaL release the leg also installs (``--no-deps`` with mbridge 0.15.1, then the ``areal``
    extra) in a venv of its own (``.venv-areal``: AReaL's transformers pin excludes Megatron-Bridge's),
    and whose plug-in tests must run there (tests/distributed/test_areal.py); None: not installed."""
    slime: str | None = None
    """The slime checkout (a folder of ``../shared/third_party``: slime is not on the package index)
    the leg gives its plug-in tests as a user's checkout (tests/distributed/test_slime.py, through
    ``MEGATRON_PG_AGG_SLIME``), where they must run; None: they skip."""
    miles: str | None = None
    """The miles checkout (a folder of ``../shared/third_party``; a user's checkout, as slime's) the leg
    gives its plug-in tests (tests/distributed/test_miles.py, through ``MEGATRON_PG_AGG_MILES``), where
    they must run; None: they skip."""
    nemo_rl: str | None = None
    """The NeMo-RL checkout (a folder of ``../shared/third_party``: NeMo-RL is not on the package index)
    the leg's NeMo-RL tests run against (through ``MEGATRON_PG_AGG_NEMO_RL``), in a venv of its own
    (``.venv-nemo-rl``, Python 3.13: docs/nemo-rl.md); None: they skip."""


TESTED: tuple[TestedRelease, ...] = (
    TestedRelease("0.16.1", "core_v0.16.1", "Megatron-LM", "3.11", "2.13.0", "full", slime="slime-624b824",
                  miles="miles-31f1ca9"),
    TestedRelease("0.15.3", "core_v0.15.3", "Megatron-LM-core_v0.15.3", "3.11", "2.13.0", "unit+megatron-lm"),
    TestedRelease("0.17.1", "core_v0.17.1", "Megatron-LM-core_v0.17.1", "3.12", "2.14.1", "unit+megatron-lm",
                  areal="1.0.4"),
    TestedRelease("0.18.2", "core_v0.18.2", "Megatron-LM-core_v0.18.2", "3.12", "2.14.1", "unit+megatron-lm"),
    TestedRelease("0.19.2", "core_v0.19.0", "Megatron-LM-core_v0.19.0", "3.12", "2.14.1", "full",
                  megatron_bridge="0.6.2", verl="0.9.1"),
    TestedRelease("0.19.2", "core_v0.19.0", "Megatron-LM-core_v0.19.0", "3.13", "2.14.1", "nemo-rl",
                  nemo_rl="nemo-rl-7ea279a"),
)
"""The CI legs, in the order .ci/run runs them (one venv per Python; only megatron-core changes).
The leg with Megatron-Bridge and verl comes last on its venv: once installed they stay, and their
imports (nvidia-modelopt and transformers, which Megatron-LM's training side and megatron-core
import when present) cost every Megatron-LM process about 11 s more on 2 cores. The NeMo-RL leg
comes last: its Python 3.13 venv (NeMo-RL's stack, Megatron-Bridge 0.6.2 inside it) is built in the
background while the first legs run."""


SUITE_NAMES = {"full": "the whole suite",
               "unit+megatron-lm": "unit suite + Megatron-LM layout tests",
               "nemo-rl": "the NeMo-RL plug-in's tests (Megatron-Bridge 0.6.2 inside NeMo-RL's stack)"}
"""The README table's words for each suite."""


def tested_table() -> str:
    """The README's tested-versions table (Markdown), generated from :data:`TESTED`."""
    rows = ["| megatron-core | Megatron-LM tag | Python | torch | megatron-bridge | verl | AReaL | slime | miles "
            "| NeMo-RL | CI runs |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for leg in TESTED:
        suite = SUITE_NAMES[leg.suite] + (" + the AReaL plug-in" if leg.areal else "")
        rows.append(f"| {leg.megatron_core} | {leg.megatron_lm_tag} | {leg.python} | {leg.torch} | "
                    f"{leg.megatron_bridge or '-'} | {leg.verl or '-'} | {leg.areal or '-'} | "
                    f"{leg.slime.removeprefix('slime-') if leg.slime else '-'} | "
                    f"{leg.miles.removeprefix('miles-') if leg.miles else '-'} | "
                    f"{leg.nemo_rl.removeprefix('nemo-rl-') if leg.nemo_rl else '-'} | {suite} |")
    return "\n".join(rows)


def distribution_version(name: str = "megatron-core") -> str | None:
    """The installed distribution ``name``'s version from its metadata alone, without importing
    it (importing ``megatron.core`` emits the start-up warnings); None when it is not installed."""
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_megatron_core_version() -> str:
    """The installed megatron-core version (the distribution metadata, else ``package_info`` of a
    source checkout on PYTHONPATH). Tests monkeypatch it where it is imported (the patch machinery,
    :mod:`megatron_pg_agg.training.run_config`) to simulate another release."""
    found = distribution_version()
    if found is not None:
        return found
    from megatron.core import package_info

    return package_info.__version__


def _version(text: str):
    from packaging.version import InvalidVersion, Version

    try:
        return Version(text)
    except InvalidVersion:
        return None


def in_range(installed: str, supported: str = SUPPORTED_MEGATRON_CORE) -> bool:
    """Whether release ``installed`` is inside the specifier set ``supported`` (pre-releases
    included; a version string that does not parse is outside)."""
    from packaging.specifiers import SpecifierSet

    version = _version(installed)
    return version is not None and SpecifierSet(supported).contains(version, prereleases=True)


def newer_than_supported(installed: str) -> bool:
    """Whether ``installed`` is a minor release at or above the range's upper bound (the ``<``
    of :data:`SUPPORTED_MEGATRON_CORE`; its pre-releases count as that release)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    version = _version(installed)
    uppers = [Version(s.version) for s in SpecifierSet(SUPPORTED_MEGATRON_CORE) if s.operator == "<"]
    return version is not None and bool(uppers) and Version(f"{version.major}.{version.minor}") >= min(uppers)


def untested_allowed() -> bool:
    """Whether the user asked, through :data:`ALLOW_UNTESTED_ENV`, to run a newer release."""
    return os.environ.get(ALLOW_UNTESTED_ENV) == "1"


_WARNED: set = set()


def release_problem(installed: str, shown: str | None = None) -> str | None:
    """Why release ``installed`` (of megatron-core, or of a Megatron-LM checkout) may not run, or
    None when it may. ``shown``: how the message names it (default ``megatron-core <installed>``).

    Inside the range: None. Older: the refusal with its reason. Newer: a refusal naming the range
    and the override; with the override set, one warning per process and None."""
    shown = shown or f"megatron-core {installed}"
    if in_range(installed):
        return None
    if newer_than_supported(installed):
        if untested_allowed():
            if shown not in _WARNED:
                _WARNED.add(shown)
                warnings.warn(f"{shown} is newer than the tested range {SUPPORTED_MEGATRON_CORE}; running "
                              f"anyway because {ALLOW_UNTESTED_ENV}=1 (the patches use the newest tested "
                              "release's targets; re-verify the objective before trusting it)",
                              RuntimeWarning, stacklevel=2)
            return None
        return (f"{shown} is newer than the tested range {SUPPORTED_MEGATRON_CORE}; set "
                f"{ALLOW_UNTESTED_ENV}=1 to run it with a warning")
    return f"{shown} is outside the supported range {SUPPORTED_MEGATRON_CORE}: {OLDER_RELEASES_REFUSED}"


def _ci_legs() -> str:
    """One line per leg for .ci/run: ``core tag checkout python torch suite bridge verl areal slime
    nemo_rl miles`` (``-`` for none)."""
    return "\n".join(" ".join((leg.megatron_core, leg.megatron_lm_tag, leg.checkout, leg.python, leg.torch,
                               leg.suite, leg.megatron_bridge or "-", leg.verl or "-", leg.areal or "-",
                               leg.slime or "-", leg.nemo_rl or "-", leg.miles or "-"))
                     for leg in TESTED)


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else "ci-legs"
    if command == "ci-legs":
        print(_ci_legs())
    elif command == "table":
        print(tested_table())
    else:
        sys.exit(f"usage: python {sys.argv[0]} [ci-legs|table]")

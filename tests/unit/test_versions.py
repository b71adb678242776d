"""The supported range, the packaging metadata and the tested-versions table (one source)."""
from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

from packaging.requirements import Requirement

from megatron_pg_agg import versions

ROOT = Path(__file__).resolve().parents[2]


def test_installed_metadata_takes_torch_and_megatron_core_as_ranges_not_pins():
    """Catches an exact torch pin in install_requires (pip would replace a GPU node's CUDA torch)
    and a megatron-core range that drifted from versions.py."""
    requires = [Requirement(r) for r in importlib.metadata.requires("megatron_pg_agg") if "extra ==" not in r]
    by_name = {r.name: r for r in requires}
    torch = by_name["torch"].specifier
    assert not any(s.operator in ("==", "===", "~=") for s in torch), torch
    for release in ("2.6.0", "2.13.0", "2.14.1"):
        assert torch.contains(release), (torch, release)
    core = by_name["megatron-core"].specifier
    assert str(core) == str(Requirement("megatron-core" + versions.SUPPORTED_MEGATRON_CORE).specifier)
    for release in ("0.15.0", "0.16.1", "0.17.1", "0.18.2", "0.19.2"):
        assert core.contains(release), release
    for release in ("0.14.0", "0.20.0"):
        assert not core.contains(release), release


def test_the_package_version_is_written_once():
    """setup.py's version (the installed metadata) and ``megatron_pg_agg.__version__`` are versions.py's
    PACKAGE_VERSION, which setup.py reads as text (the package cannot be imported before its dependencies)."""
    import megatron_pg_agg

    assert importlib.metadata.version("megatron_pg_agg") == versions.PACKAGE_VERSION == megatron_pg_agg.__version__
    assert 'version=_versions_constant("PACKAGE_VERSION")' in (ROOT / "setup.py").read_text()


def test_the_readme_table_is_the_tested_legs():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- tested-versions:[^\n]*-->\n(.*?)\n<!-- /tested-versions -->", readme, re.S)
    assert block and block.group(1).strip() == versions.tested_table()
    for leg in versions.TESTED:  # every row is a leg, in the order .ci/run runs them
        assert (f"| {leg.megatron_core} | {leg.megatron_lm_tag} | {leg.python} | {leg.torch} | "
                f"{leg.megatron_bridge or '-'} | {leg.verl or '-'} | {leg.areal or '-'} |") in block.group(1)


def test_ci_runs_the_legs_of_versions_py():
    """.ci/run reads its legs from versions.py (the same rows as the README's table), and every
    leg is inside the supported range, of the checkout's release."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert "megatron_pg_agg/versions.py ci-legs" in ci
    lines = versions._ci_legs().splitlines()
    assert len(lines) == len(versions.TESTED) >= 5
    for line, leg in zip(lines, versions.TESTED):
        core, tag, checkout, python, torch, suite, bridge, verl, areal, slime, nemo_rl, miles = line.split()
        assert bridge == (leg.megatron_bridge or "-") and verl == (leg.verl or "-") and areal == (leg.areal or "-")
        assert slime == (leg.slime or "-") and nemo_rl == (leg.nemo_rl or "-") and miles == (leg.miles or "-")
        assert versions.in_range(core) and suite in versions.SUITE_NAMES
        assert tag.startswith("core_v" + ".".join(core.split(".")[:2]))
        assert checkout == leg.checkout
    assert {leg.megatron_core.rsplit(".", 1)[0] for leg in versions.TESTED} == {"0.15", "0.16", "0.17", "0.18", "0.19"}
    # the README's whole suite runs first, on the default Python, and again on the newest release (the
    # last leg of the whole suite; only the NeMo-RL leg, on NeMo-RL's own stack, may follow it)
    assert versions.TESTED[0].suite == "full" and versions.TESTED[0].python == "3.11"
    release = lambda leg: tuple(map(int, leg.megatron_core.split(".")))  # noqa: E731
    full = [leg for leg in versions.TESTED if leg.suite == "full"]
    assert release(full[-1]) == max(map(release, versions.TESTED))
    after = versions.TESTED[versions.TESTED.index(full[-1]) + 1:]
    assert all(leg.suite == "nemo-rl" and leg.nemo_rl for leg in after)
    assert [leg.python for leg in versions.TESTED if leg.nemo_rl] == ["3.13"]
    # the Bridge tests run on the megatron-core 0.19 leg (megatron-bridge 0.6's release)
    bridged = [leg for leg in versions.TESTED if leg.megatron_bridge]
    assert [(leg.megatron_core[:5], leg.python, leg.suite) for leg in bridged] == [("0.19.", "3.12", "full")]
    # verl builds through Megatron-Bridge: its plug-in tests run on that same leg
    assert [leg for leg in versions.TESTED if leg.verl] == bridged


def test_releases_outside_the_range_are_refused_with_reasons(monkeypatch):
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV, raising=False)
    for release in ("0.15.0", "0.16.1", "0.19.2", "0.19.3rc1"):
        assert versions.release_problem(release) is None, release
    older = versions.release_problem("0.14.0")
    assert "0.14.0" in older and "before 0.15" in older
    newer = versions.release_problem("0.20.1")
    assert "0.20.1 is newer than the tested range" in newer and versions.ALLOW_UNTESTED_ENV in newer
    assert versions.release_problem("0.20.0rc1") == newer.replace("0.20.1", "0.20.0rc1")
    monkeypatch.setenv(versions.ALLOW_UNTESTED_ENV, "1")
    assert versions.release_problem("0.14.0") is not None  # never for older releases
    assert versions.release_problem("not-a-version") is not None


def test_the_checkout_table_names_each_legs_tag_and_folder():
    """docs/releases.md's clone table: one row per leg, its tag in the clone command and the
    folder the tests look for (versions.TESTED's checkout)."""
    text = (ROOT / "docs" / "releases.md").read_text()
    for leg in versions.TESTED:
        row = (f"| {leg.megatron_core} | `git clone --depth 1 --branch {leg.megatron_lm_tag} "
               f"https://github.com/NVIDIA/Megatron-LM` | `{leg.checkout}` |")
        assert row in text, row

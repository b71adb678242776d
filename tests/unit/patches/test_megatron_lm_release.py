"""How a Megatron-LM checkout's release is recognised (from the checkout itself) and checked.

The reference is each training side's PROVENANCE.md (the tag it was copied from), which the
recognition never reads."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_pg_agg import versions
from megatron_pg_agg.patches import _megatron_lm_release as release_mod
from megatron_pg_agg.patches._megatron_lm_release import (
    CheckoutRelease,
    UnsupportedMegatronLM,
    check_release,
    checkout_release,
)


def _provenance_tag(path: Path) -> tuple[int, int]:
    tag = re.search(r"tag `core_v(\d+)\.(\d+)\.\d+`", (path / "PROVENANCE.md").read_text())
    return int(tag.group(1)), int(tag.group(2))


def test_every_training_side_is_recognised_as_the_tag_it_came_from(third_party_checkouts):
    """Catches a fingerprint that is also present in an older release (0.17's config/ would
    name 0.18 and 0.19 '0.17' if listed first), or one that a newer release dropped (0.16's
    common_config.py is gone in 0.17)."""
    for name, path in third_party_checkouts.items():
        got = checkout_release(str(path))
        assert got.minor == _provenance_tag(path), (name, got)
        assert got.version == f"{got.minor[0]}.{got.minor[1]}.x" and got.source.startswith(str(path))
        assert got.uses_config_container == (got.minor >= (0, 18)), name


def test_package_info_of_a_full_checkout_names_the_release(tmp_path):
    """A git checkout has megatron/core/package_info.py: it wins over the fingerprint (here a
    core_v0.19 file next to a 0.17.1 package_info)."""
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    (tmp_path / "megatron" / "training").mkdir()
    (tmp_path / "megatron" / "training" / "determinism.py").write_text("")
    (tmp_path / "megatron" / "core" / "package_info.py").write_text(
        "MAJOR = 0\nMINOR = 17\nPATCH = 1\nPRE_RELEASE = ''\n")
    got = checkout_release(str(tmp_path))
    assert (got.minor, got.version, got.tag) == ((0, 17), "0.17.1", "core_v0.17.1")
    assert got.source.endswith("package_info.py")


def test_a_training_side_older_than_core_v0_15_is_refused(tmp_path):
    (tmp_path / "megatron" / "training").mkdir(parents=True)
    (tmp_path / "megatron" / "training" / "arguments.py").write_text("group.add_argument('--fp8-format')\n")
    with pytest.raises(UnsupportedMegatronLM, match="older than core_v0.15"):
        checkout_release(str(tmp_path))


def _release(minor) -> CheckoutRelease:
    return CheckoutRelease("/ckpt", minor, f"{minor[0]}.{minor[1]}.x", "/ckpt/fingerprint")


def test_a_checkout_must_be_the_installed_megatron_cores_minor_release(monkeypatch):
    monkeypatch.setattr(release_mod, "installed_megatron_core_version", lambda: "0.19.2")
    check_release(_release((0, 19)))
    with pytest.raises(UnsupportedMegatronLM) as err:
        check_release(_release((0, 18)))
    assert "core_v0.18.x" in str(err.value) and "megatron-core 0.19.2" in str(err.value)


def test_a_checkout_newer_than_the_range_is_refused_unless_overridden(monkeypatch):
    monkeypatch.setattr(release_mod, "installed_megatron_core_version", lambda: "0.20.0")
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(UnsupportedMegatronLM) as err:
        check_release(_release((0, 20)))
    assert "core_v0.20.x" in str(err.value) and versions.SUPPORTED_MEGATRON_CORE in str(err.value)
    assert versions.ALLOW_UNTESTED_ENV in str(err.value)
    monkeypatch.setenv(versions.ALLOW_UNTESTED_ENV, "1")
    monkeypatch.setattr(versions, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="core_v0.20.x"):
        check_release(_release((0, 20)))
    with pytest.raises(UnsupportedMegatronLM, match="megatron-core 0.20.0"):
        check_release(_release((0, 19)))  # the override never allows a mismatch


def test_an_older_checkout_is_refused_even_with_the_override(monkeypatch):
    monkeypatch.setattr(release_mod, "installed_megatron_core_version", lambda: "0.14.0")
    monkeypatch.setenv(versions.ALLOW_UNTESTED_ENV, "1")
    with pytest.raises(UnsupportedMegatronLM, match="before 0.15"):
        check_release(_release((0, 14)))

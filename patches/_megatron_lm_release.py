"""Which Megatron-LM training sides this project supports, and how a checkout's release is known.

Megatron-LM is used from a user's checkout (``--megatron-lm PATH`` or ``MEGATRON_LM_PATH``). Its
release is read from the checkout itself:

1. ``megatron/core/package_info.py`` (every git checkout of Megatron-LM has it: the tag's
   megatron-core version, ``MAJOR``/``MINOR``/``PATCH``), read as text;
2. where the checkout holds only the training side (no ``megatron/core``; the installed package
   supplies it), a fingerprint of files each release added (:data:`FINGERPRINTS`, newest first;
   it tells the minor release, not the patch level, and cannot tell a future release from the
   newest one it knows).

The release must be the installed megatron-core's minor release (the training side calls
megatron-core's internals of its own release), inside the supported range (a newer one only
under the documented override), and ``megatron.training.pretrain`` must have that release's
signature (:data:`PRETRAIN_PARAMETERS`): a cross-check that the right code is on the path.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import re
from dataclasses import dataclass
from typing import Optional

from packaging.version import Version

from ..versions import installed_megatron_core_version, release_problem

SUPPORTED_TAGS = "core_v0.15.x to core_v0.19.x"
"""The Megatron-LM tags whose training side the project was written and tested against."""

FINGERPRINTS: tuple[tuple[tuple[int, int], str, Optional[str]], ...] = (
    ((0, 19), "megatron/training/determinism.py", None),
    ((0, 18), "megatron/training/models", None),
    ((0, 17), "megatron/training/config", None),
    ((0, 16), "megatron/training/common_config.py", None),  # gone again in 0.17
    ((0, 15), "megatron/training/arguments.py", "'--fp4-format'"),  # a flag 0.15 added
)
"""``(release, path, text)``, newest first: the first whose path exists (and holds ``text``)
names a training-side-only checkout's minor release. Read from the tags core_v0.14.0 to core_v0.19.0."""

_V015_PRETRAIN = (
    "train_valid_test_dataset_provider", "model_provider", "model_type", "forward_step_func",
    "process_non_loss_data_func", "extra_args_provider", "args_defaults", "get_embedding_ranks",
    "get_position_embedding_ranks", "non_loss_data_func", "store", "inprocess_call_wrapper",
)
PRETRAIN_PARAMETERS: dict[tuple[int, int], tuple[str, ...]] = {
    (0, 15): _V015_PRETRAIN,
    (0, 16): _V015_PRETRAIN,
    (0, 17): _V015_PRETRAIN,
    # 0.18: a config container first; extra_args_provider and args_defaults move to
    # parse_and_validate_args
    (0, 18): ("cfg_container", "train_valid_test_dataset_provider", "model_provider", "model_type",
              "forward_step_func", "process_non_loss_data_func", "get_embedding_ranks",
              "get_position_embedding_ranks", "non_loss_data_func", "store", "inprocess_call_wrapper"),
    # 0.19: model_provider after forward_step_func (optional), and the process-group arguments
    (0, 19): ("cfg_container", "train_valid_test_dataset_provider", "model_type", "forward_step_func",
              "model_provider", "process_non_loss_data_func", "get_embedding_ranks",
              "get_position_embedding_ranks", "non_loss_data_func", "store", "inprocess_call_wrapper",
              "p2p_communicator", "pg_collection", "skip_model_parallel_init"),
}
"""``megatron.training.pretrain``'s parameters per release (read at core_v0.15.3 ... core_v0.19.0)."""
NEWEST = max(PRETRAIN_PARAMETERS)


class UnsupportedMegatronLM(RuntimeError):
    """The Megatron-LM checkout is not a release the project supports."""


@dataclass(frozen=True)
class CheckoutRelease:
    """The release of a Megatron-LM checkout, and how it was recognised."""

    root: str
    minor: tuple[int, int]
    """``(major, minor)``, e.g. ``(0, 19)``."""
    version: str
    """``0.19.1`` from package_info, or ``0.19.x`` from the fingerprint."""
    source: str
    """What named it: the package_info path, or the fingerprint file."""

    @property
    def tag(self) -> str:
        return f"core_v{self.version}"

    @property
    def uses_config_container(self) -> bool:
        """From core_v0.18 ``pretrain()`` takes a config container (``parse_and_validate_args`` ->
        ``pretrain_cfg_container_from_args`` -> ``pretrain(cfg, ...)``)."""
        return self.minor >= (0, 18)


def checkout_release(root: str) -> CheckoutRelease:
    """The release of the Megatron-LM checkout at ``root`` (see the module docstring); raises
    :class:`UnsupportedMegatronLM` for a training side older than core_v0.15."""
    info = os.path.join(root, "megatron", "core", "package_info.py")
    if os.path.isfile(info):
        with open(info) as f:
            text = f.read()
        found = {k: re.search(rf"^{k} = (\d+)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")}
        if all(found.values()):
            major, minor, patch = (int(m.group(1)) for m in found.values())
            return CheckoutRelease(root, (major, minor), f"{major}.{minor}.{patch}", info)
    for minor, path, text in FINGERPRINTS:
        full = os.path.join(root, path)
        if os.path.exists(full) and (text is None or text in open(full).read()):
            return CheckoutRelease(root, minor, f"{minor[0]}.{minor[1]}.x", full)
    raise UnsupportedMegatronLM(
        f"the Megatron-LM checkout {root} is older than core_v0.15 (it has neither "
        f"megatron/core/package_info.py nor any training-side file of core_v0.15 to core_v0.19); "
        f"supported: {SUPPORTED_TAGS}. Check out one of those tags.")


def check_pretrain_signature(pretrain, release: tuple[int, int] = (0, 16)) -> None:
    """Raise :class:`UnsupportedMegatronLM` unless ``pretrain`` has ``release``'s signature."""
    expected = PRETRAIN_PARAMETERS[min(release, NEWEST)]
    found = tuple(inspect.signature(pretrain).parameters)
    if found != expected:
        missing = [p for p in expected if p not in found]
        extra = [p for p in found if p not in expected]
        tag = f"core_v{release[0]}.{release[1]}.x"
        raise UnsupportedMegatronLM(
            f"this Megatron-LM checkout's megatron.training.pretrain{inspect.signature(pretrain)} is "
            f"not the one of {tag}, the release the checkout names (missing {missing}, unknown "
            f"{extra}); a modified checkout, or another megatron.training on the path. Supported: "
            f"{SUPPORTED_TAGS}.")


def check_release(release: CheckoutRelease) -> None:
    """Refuse a checkout outside the supported range (newer: unless the override is set) or
    of another minor release than the installed megatron-core, naming both versions."""
    installed = installed_megatron_core_version()
    shown = f"the Megatron-LM checkout {release.root} ({release.tag}, from {release.source})"
    problem = release_problem(f"{release.minor[0]}.{release.minor[1]}.0", shown)
    if problem is not None:
        raise UnsupportedMegatronLM(f"{problem}. Supported tags: {SUPPORTED_TAGS}.")

    core = Version(installed)
    if (core.major, core.minor) != release.minor:
        raise UnsupportedMegatronLM(
            f"the Megatron-LM checkout {release.root} is {release.tag} (from {release.source}) but "
            f"megatron-core {installed} is installed: the training side calls megatron-core's "
            f"internals of its own release. Use the checkout's tag core_v{core.major}.{core.minor}.x, "
            f"or install megatron-core=={release.minor[0]}.{release.minor[1]}.*.")


def loaded_checkout_root() -> str:
    """The root of the Megatron-LM checkout that ``megatron.training`` would be imported from,
    found without importing it: a training side of another release may fail to import against
    the installed megatron-core, and the refusal must name the versions, not that error."""
    spec = importlib.util.find_spec("megatron.training")
    if spec is None or not spec.submodule_search_locations:
        raise UnsupportedMegatronLM(
            f"no megatron.training on the path: put a Megatron-LM checkout ({SUPPORTED_TAGS}) there "
            "(--megatron-lm PATH or MEGATRON_LM_PATH)")
    return os.path.dirname(os.path.dirname(os.path.abspath(list(spec.submodule_search_locations)[0])))


def check_checkout() -> CheckoutRelease:
    """Recognise the release of the checkout ``megatron.training`` comes from, check it against
    the installed megatron-core, then import ``pretrain`` and check its signature."""
    release = checkout_release(loaded_checkout_root())
    check_release(release)
    try:
        # the checkout's own module, importable only once the checkout is on sys.path
        from megatron.training import training  # noqa: PLC0415
    except ImportError as exc:
        raise UnsupportedMegatronLM(
            f"megatron.training of {release.root} ({release.tag}) cannot be imported ({exc}); install its "
            "imports (pip install -e '.[megatron-lm]')") from exc

    check_pretrain_signature(training.pretrain, release.minor)
    return release

"""A small, reusable mechanism for runtime patches of megatron-core.

Why a mechanism and not ad-hoc ``setattr`` calls: a runtime patch of a third-party library is only
safe when it (1) refuses to run against a release it was not written for, (2) refuses to run when
a symbol it wraps has moved, and in both cases fails *before* touching anything, so a half-applied
patch never exists, (3) is idempotent, and (4) can be undone exactly. The style follows
Liger-Kernel's Megatron patch module (wrap, never copy, the upstream function), plus a public
revert.

A :class:`Patch` is a name, the megatron-core versions it supports (a ``packaging``
``SpecifierSet``), a WHY docstring, an optional precondition and a list of :class:`Target` s.
A target is ``module path + attribute name + make(original) -> replacement``, optionally with the
megatron-core releases where it exists (``releases``: symbols move between releases, so each is
looked up only where it lives; the patch's ``supported`` range covers the whole patch). The attribute may
be dotted (``"SomeClass.method"``) to reach a class attribute; it must then be defined on that
class itself (not inherited), so that revert can restore it exactly.

Applying sets, on every replacement, ``__wrapped__ = original`` (``functools.update_wrapper``
for functions) and the marker attribute ``_megatron_pg_agg_patch = <patch name>``.

A patch may also carry :class:`StandIn` modules: a module that cannot be imported on this machine
(it imports a GPU-only package at its top) and that a target module imports by name. The
stand-in is put in ``sys.modules`` only when importing the real module fails with the named
missing package, before the targets are resolved; revert removes it again. Where the real module
imports (the package is installed), nothing is stood in.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from packaging.specifiers import SpecifierSet

from ..versions import in_range, installed_megatron_core_version, newer_than_supported, release_problem

MARKER = "_megatron_pg_agg_patch"
"""Attribute set on every replacement: the name of the patch that installed it."""


def _in_releases(releases: Optional[str], installed: str) -> bool:
    return releases is None or in_range(installed, releases)


@dataclass(frozen=True)
class Target:
    """One attribute to replace: ``getattr(import_module(module), attr)`` (attr may be dotted)."""

    module: str
    attr: str
    make: Callable[[Any], Any]
    """``make(original) -> replacement``; called once per apply, after every check passed."""
    releases: Optional[str] = None
    """The megatron-core releases (a specifier set) where this target exists and is needed;
    None: every release the patch supports. Outside it the target is not resolved or touched
    (a symbol megatron-core added, moved or dropped in some release)."""

    def __post_init__(self) -> None:
        if self.releases is not None:
            SpecifierSet(self.releases)  # fail at definition time on a malformed range

    def applies_to(self, installed: str) -> bool:
        """Whether this target is patched on megatron-core ``installed``."""
        return _in_releases(self.releases, installed)

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.attr}"


@dataclass(frozen=True)
class StandIn:
    """A module put in ``sys.modules`` in place of one that cannot be imported here."""

    module: str
    missing: str
    """The package whose absence makes the real module unimportable: a top-level one (e.g.
    ``triton``), or a dotted one where a distribution installs a subpackage of a shared namespace
    (``megatron.bridge``, not installed beside megatron-core); any other import error is raised,
    not hidden."""
    make: Callable[[str], types.ModuleType]
    """``make(module name) -> module``; called once per apply, only when the stand-in is needed."""
    releases: Optional[str] = None
    """The megatron-core releases that have the module (as ``Target.releases``); None: all."""

    def applies_to(self, installed: str) -> bool:
        """Whether this module is stood in for (where needed) on megatron-core ``installed``."""
        return _in_releases(self.releases, installed)


@dataclass(frozen=True)
class Patch:
    """A named runtime patch of megatron-core (see the module docstring)."""

    name: str
    supported: str
    """PEP 440 specifier set of the megatron-core releases the patch was written and tested for."""
    why: str
    targets: tuple[Target, ...]
    precondition: Optional[Callable[[], None]] = None
    """Called before anything is touched; raises (with a clear message) to refuse the patch."""
    stand_ins: tuple[StandIn, ...] = ()
    """Modules stood in (see the module docstring) before the targets are resolved."""
    verify: Optional[Callable[[], None]] = None
    """Called after the stand-ins are in place and before the targets are resolved: checks the
    patched library's own release where its version is not a distribution's (a Megatron-LM
    checkout); raises to refuse the patch (the stand-ins are then removed again)."""
    unsupported_reason: Optional[str] = None
    """Why the project's releases outside ``supported`` cannot take the patch (said in the
    refusal); None: the generic "re-verify before widening the range"."""

    def __post_init__(self) -> None:
        SpecifierSet(self.supported)  # fail at definition time on a malformed range
        if not self.targets:
            raise ValueError(f"patch {self.name!r} has no targets")


@dataclass
class _Installed:
    owner: Any
    attr: str
    original: Any
    replacement: Any


@dataclass
class _StoodIn:
    name: str
    module: types.ModuleType


def require_distribution(name: str, distribution: str, version: Optional[str], supported: str) -> None:
    """A precondition's release check of a patched library other than megatron-core: refuse patch ``name``
    unless ``distribution``'s installed ``version`` (None: not installed) is in ``supported``."""
    if version is None or not in_range(version, supported):
        raise RuntimeError(f"patch {name!r} supports {distribution} {supported!r}, but "
                           f"{'none' if version is None else version} is installed; nothing was patched.")


def patch_family(*, supported: str, refusal: Callable[[str], Callable[[], None]],
                 verify: Optional[Callable[[str], Callable[[], None]]] = None,
                 unsupported_reason: Optional[str] = None) -> Callable[..., Patch]:
    """The ``Patch`` maker of one family of patches (a host's CPU stand-ins): the family's megatron-core
    range, its refusal (``refusal(name)`` -> the precondition), its release check (``verify(name)``) and
    its out-of-range reason are written once. Returns ``make(name, why, *targets, stand_ins=(),
    precondition=None) -> Patch``; a ``precondition`` given to ``make`` replaces the family's refusal
    (and must refuse the same way itself)."""

    def make(name: str, why: str, *targets: Target, stand_ins: tuple[StandIn, ...] = (),
             precondition: Optional[Callable[[], None]] = None) -> Patch:
        return Patch(name=name, supported=supported, why=why, targets=targets, stand_ins=stand_ins,
                     precondition=precondition or refusal(name), verify=verify(name) if verify else None,
                     unsupported_reason=unsupported_reason)

    return make


_APPLIED: dict[str, list[_Installed]] = {}
"""Patch name -> what it replaced, in application order. The single source of truth."""
_STOOD_IN: dict[str, list[_StoodIn]] = {}
"""Patch name -> the stand-in modules it put in ``sys.modules``."""


def check_version(patch: Patch) -> str:
    """Return the installed megatron-core release, or raise ``RuntimeError`` unless it is in
    ``patch.supported`` (a newer release passes only under the documented override, with a
    warning: :func:`megatron_pg_agg.versions.release_problem`)."""
    installed = installed_megatron_core_version()
    if in_range(installed, patch.supported):
        return installed
    problem = release_problem(installed)
    if problem is None and newer_than_supported(installed):
        return installed  # newer than the range under the documented override (it warned)
    raise RuntimeError(
        f"patch {patch.name!r} supports megatron-core {patch.supported!r}, but megatron-core "
        f"{installed} is installed; nothing was patched. "
        + (problem or patch.unsupported_reason or "Re-verify the patch against this release before widening its range.")
    )


def active_targets(patch: Patch, installed: str) -> tuple[Target, ...]:
    """The targets of ``patch`` that exist on megatron-core ``installed`` (see ``Target.releases``)."""
    return tuple(t for t in patch.targets if t.applies_to(installed))


MISSING_PACKAGE_EXTRAS = {
    # top-level import name -> (distribution, the extra of megatron_pg_agg that installs it)
    "openai": ("openai", "megatron-rl"), "wandb": ("wandb", "megatron-rl"), "httpx": ("httpx", "megatron-rl"),
    "fastapi": ("fastapi", "megatron-rl"), "uvicorn": ("uvicorn", "megatron-rl"), "tqdm": ("tqdm", "megatron-rl"),
    "six": ("six", "megatron-lm"), "regex": ("regex", "megatron-lm"), "yaml": ("pyyaml", "megatron-lm"),
    "pydantic": ("pydantic", "megatron-lm"), "psutil": ("psutil", "megatron-lm"),
    "transformers": ("transformers", "bridge"), "omegaconf": ("omegaconf", "bridge"), "einops": ("einops", "bridge"),
    "safetensors": ("safetensors", "bridge"), "modelopt": ("nvidia-modelopt", "bridge"),
    "datasets": ("datasets", "bridge"),
}
"""What a patch target's module may import that a plain install lacks, and where it comes from."""


def _missing_package(exc: ImportError) -> Optional[str]:
    """The top-level package a failed import lacks (None: the module itself moved, or another error)."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    return exc.name.split(".")[0]


def _resolve(target: Target, patch_name: str) -> tuple[Any, str, Any]:
    """Return ``(owner, leaf attribute name, current value)`` or raise a clear error: a missing
    dependency is named as such (with the extra that installs it), a moved module as moved."""
    try:
        owner: Any = importlib.import_module(target.module)
    except ImportError as exc:
        missing = _missing_package(exc)
        if missing is not None and missing != "megatron" and not target.module.startswith(exc.name + "."):
            dist, extra = MISSING_PACKAGE_EXTRAS.get(missing, (missing, None))
            how = f'pip install -e ".[{extra}]"' if extra else f"pip install {dist}"
            raise RuntimeError(
                f"patch {patch_name!r}: module {target.module!r} imports {exc.name!r}, which is not installed: "
                f"a missing dependency ({dist}; {how}). Nothing was patched."
            ) from exc
        raise RuntimeError(
            f"patch {patch_name!r}: module {target.module!r} cannot be imported ({exc}); "
            f"megatron-core moved it. Nothing was patched."
        ) from exc
    *path, leaf = target.attr.split(".")
    for part in path:
        if not hasattr(owner, part):
            raise RuntimeError(
                f"patch {patch_name!r}: {target.module}.{'.'.join(path)} is missing "
                f"(megatron-core moved or renamed it). Nothing was patched."
            )
        owner = getattr(owner, part)
    if inspect.isclass(owner):
        if leaf not in vars(owner):
            raise RuntimeError(
                f"patch {patch_name!r}: {target.qualname} is not defined on "
                f"{owner.__qualname__} itself (missing, or inherited: patch the defining class). "
                f"Nothing was patched."
            )
        current = vars(owner)[leaf]
    elif hasattr(owner, leaf):
        current = getattr(owner, leaf)
    else:
        raise RuntimeError(
            f"patch {patch_name!r}: {target.qualname} is missing (megatron-core moved or "
            f"renamed it). Nothing was patched."
        )
    return owner, leaf, current


def _mark(replacement: Any, original: Any, patch_name: str) -> Any:
    if isinstance(replacement, types.FunctionType) and callable(original):
        functools.update_wrapper(replacement, original)
    replacement.__wrapped__ = original
    setattr(replacement, MARKER, patch_name)
    return replacement


def is_applied(patch: Patch | str) -> bool:
    """Whether the patch (or patch name) is currently applied."""
    return (patch if isinstance(patch, str) else patch.name) in _APPLIED


def applied() -> list[str]:
    """Names of the applied patches, in application order."""
    return list(_APPLIED)


def apply(patch: Patch) -> bool:
    """Apply ``patch``; return False if it was already applied (a no-op), True otherwise.

    Order: version check, precondition, stand-ins, verify, resolve every target; only then
    replace. Any failure before the replacement leaves megatron-core untouched (stand-ins put in
    place by this call are removed again).
    """
    if patch.name in _APPLIED:
        return False
    installed = check_version(patch)
    targets = active_targets(patch, installed)
    if patch.precondition is not None:
        patch.precondition()
    stood_in = _stand_in(patch, installed)
    try:
        if patch.verify is not None:
            patch.verify()
        resolved = [_resolve(t, patch.name) for t in targets]
        for target, (_, _, current) in zip(targets, resolved):
            other = getattr(current, MARKER, None)
            if other is not None:
                raise RuntimeError(
                    f"patch {patch.name!r}: {target.qualname} is already replaced by patch "
                    f"{other!r}; two patches may not wrap the same attribute. Nothing was patched."
                )
    except BaseException:
        _remove_stand_ins(stood_in)
        raise
    _STOOD_IN[patch.name] = stood_in
    replacements = [t.make(current) for t, (_, _, current) in zip(targets, resolved)]
    installed: list[_Installed] = []
    for (owner, leaf, current), replacement in zip(resolved, replacements):
        setattr(owner, leaf, _mark(replacement, current, patch.name))
        installed.append(_Installed(owner, leaf, current, replacement))
    _APPLIED[patch.name] = installed
    return True


def apply_in_order(patches: Iterable[Patch]) -> list[str]:
    """Apply ``patches`` one after the other (:func:`apply`); return the names this call applied
    (already applied: skipped). The first refusal raises ``RuntimeError`` with that patch untouched
    and the ones before it applied."""
    return [patch.name for patch in patches if apply(patch)]


def revert(patch: Patch | str) -> bool:
    """Restore the originals of an applied patch; return False if it was not applied.

    Raises (before restoring anything) if some target was replaced again by someone else since,
    since restoring our original would silently drop their replacement.
    """
    name = patch if isinstance(patch, str) else patch.name
    installed = _APPLIED.get(name)
    if installed is None:
        return False
    for item in installed:
        current = vars(item.owner).get(item.attr) if inspect.isclass(item.owner) else getattr(
            item.owner, item.attr, None
        )
        if current is not item.replacement:
            raise RuntimeError(
                f"cannot revert patch {name!r}: {getattr(item.owner, '__name__', item.owner)}."
                f"{item.attr} was replaced by something else after the patch was applied. "
                f"Nothing was reverted."
            )
    for item in reversed(installed):
        setattr(item.owner, item.attr, item.original)
    del _APPLIED[name]
    _remove_stand_ins(_STOOD_IN.pop(name, []))
    return True


def _is_or_inside(module: str, package: str) -> bool:
    """Whether ``module`` is ``package`` itself or one of its submodules (``a.b`` is inside ``a``)."""
    return module == package or module.startswith(package + ".")


def _stand_in(patch: Patch, installed: str) -> list[_StoodIn]:
    """Import each stand-in's real module; where it fails for the named missing package only,
    put the stand-in in ``sys.modules`` (and on its parent package). Returns what was stood in."""
    done: list[_StoodIn] = []
    for item in patch.stand_ins:
        if not item.applies_to(installed):
            continue
        try:
            importlib.import_module(item.module)
            continue
        except ModuleNotFoundError as exc:
            if exc.name is None or not _is_or_inside(exc.name, item.missing):
                _remove_stand_ins(done)
                raise RuntimeError(
                    f"patch {patch.name!r}: {item.module} cannot be imported ({exc}), and not for "
                    f"the missing {item.missing!r} that its stand-in replaces. Nothing was patched."
                ) from exc
        module = item.make(item.module)
        setattr(module, MARKER, patch.name)
        sys.modules[item.module] = module
        parent, _, leaf = item.module.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], leaf, module)
        done.append(_StoodIn(item.module, module))
    return done


def _remove_stand_ins(stood_in: list[_StoodIn]) -> None:
    for item in reversed(stood_in):
        if sys.modules.get(item.name) is item.module:
            del sys.modules[item.name]
        parent, _, leaf = item.name.rpartition(".")
        if parent in sys.modules and getattr(sys.modules[parent], leaf, None) is item.module:
            delattr(sys.modules[parent], leaf)


def stood_in(patch: Patch | str) -> list[str]:
    """Names of the modules an applied patch stood in (empty where the real ones imported)."""
    return [item.name for item in _STOOD_IN.get(patch if isinstance(patch, str) else patch.name, [])]

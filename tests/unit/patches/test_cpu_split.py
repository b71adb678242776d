"""The split of every patch folder: every patch in a ``cpu`` folder (``patches/cpu``, ``integrations/<host>/cpu``) is a
CPU-only stand-in (it refuses to apply where CUDA is available), and no patch outside one (the top of patches/, a
host's own patch such as verl's engine patch) is one (its precondition does not look at CUDA), so a reader can tell
at a glance which modules can change a run on a GPU."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from megatron_pg_agg import integrations, patches
from megatron_pg_agg.patches._machinery import Patch

FOLDER = Path(patches.__file__).parent
INTEGRATIONS = Path(integrations.__file__).parent
CUDA_REFUSAL = "torch.cuda.is_available()"
"""What every CPU stand-in's refusal names (the project's wording: cpu_gloo's precondition)."""


def _modules(package: str, folder: Path) -> list:
    return [f"{package}.{path.stem}" for path in sorted(folder.glob("*.py")) if path.stem != "__init__"]


def _own_patches(module_name: str) -> list:
    """``(attribute, Patch)`` of every Patch a module defines at its top."""
    module = importlib.import_module(module_name)
    return [(name, value) for name, value in vars(module).items() if isinstance(value, Patch)]


def _host_modules(cpu: bool) -> list:
    """The modules of every host folder of integrations/: those of its ``cpu`` folder, or its own patches of the
    host's code (``*_patch.py``; the plug-ins themselves import their host at the top)."""
    found = []
    for path in sorted(INTEGRATIONS.glob("*/**/*.py")):
        parts = path.relative_to(INTEGRATIONS).with_suffix("").parts
        if ("cpu" in parts) == cpu and (cpu or path.stem.endswith("_patch")):
            found.append(".".join(("megatron_pg_agg.integrations", *(p for p in parts if p != "__init__"))))
    return found


CPU_MODULES = _modules("megatron_pg_agg.patches.cpu", FOLDER / "cpu") + _host_modules(cpu=True)
TOP_MODULES = _modules("megatron_pg_agg.patches", FOLDER) + _host_modules(cpu=False)
CPU_PATCHES = [pytest.param(patch, id=f"{module}.{name}")
               for module in CPU_MODULES for name, patch in _own_patches(module)]
TOP_PATCHES = [pytest.param(patch, id=f"{module}.{name}")
               for module in TOP_MODULES for name, patch in _own_patches(module)]


def _outcome(precondition) -> str:
    """What a precondition answers: ``"applies"`` or the refusal's type and message."""
    try:
        precondition()
    except Exception as exc:  # any refusal is an answer to compare
        return f"{type(exc).__name__}: {exc}"
    return "applies"


def test_every_patch_of_the_registry_is_checked_below():
    """``apply_megatron_patches``' patches are each defined in patches/ or patches/cpu (checked below), and the
    walk reaches the hosts' folders: their stand-ins and their own patches are checked too."""
    checked = [p.values[0] for p in CPU_PATCHES + TOP_PATCHES]
    assert all(any(patch is c for c in checked) for patch in patches.PATCHES.values())
    assert {p.values[0].name for p in CPU_PATCHES} >= {"cpu_gloo", "megatron_lm_cpu", "areal_engine_cpu", "bridge_cpu",
                                                     "nemo_rl_cuda_iterator"}
    assert {p.values[0].name for p in TOP_PATCHES} >= {"moe_aux_loss", "verl_engine", "areal_actor"}


@pytest.mark.parametrize("patch", CPU_PATCHES)
def test_every_cpu_stand_in_refuses_where_cuda_is_available(patch, monkeypatch):
    """Its precondition (run first by the machinery, before anything is touched) refuses under a faked CUDA,
    for that reason: without CUDA it does not refuse for it."""
    assert patch.precondition is not None, f"{patch.name} has no precondition: it would apply on a GPU"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError) as err:
        patch.precondition()
    assert CUDA_REFUSAL in str(err.value), str(err.value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert CUDA_REFUSAL not in _outcome(patch.precondition)


@pytest.mark.parametrize("patch", TOP_PATCHES)
def test_no_patch_at_the_top_is_a_cpu_stand_in(patch, monkeypatch):
    """A patch at the top of patches/ can change a run on any device: its precondition answers the same with and
    without CUDA (a CPU-only stand-in belongs in patches/cpu)."""
    if patch.precondition is None:
        return
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with_cuda = _outcome(patch.precondition)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert with_cuda == _outcome(patch.precondition), with_cuda
    assert CUDA_REFUSAL not in with_cuda

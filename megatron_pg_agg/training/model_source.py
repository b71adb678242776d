"""A model the trainer does not build itself (``--hf-model``): a seam the integrations fill.

The trainer asks for a source by kind and path; the installed package's entry points of group
:data:`GROUP` map each kind to an opener ``open(path) -> ModelSource`` (setup.py:
``hf = megatron_pg_agg.integrations.bridge.hf_model:open_hf_model``, through Megatron-Bridge). So the
training layer never imports an integration, and another source (a different converter) plugs in
by adding an entry point, not by editing the trainer.
"""
from __future__ import annotations

import importlib.metadata
from typing import Any, Protocol

__all__ = ["GROUP", "ModelSource", "ModelSourceError", "open_model_source"]

GROUP = "megatron_pg_agg.model_sources"
"""The entry-point group of the model sources."""


class ModelSourceError(ValueError):
    """A source that cannot be opened or does not fit the model (the message names the file and
    the reason): the trainer refuses the start with it."""


class ModelSource(Protocol):
    """What the trainer needs of an opened source."""

    shape: Any
    """The model's shape (``num_layers``, ``hidden_size``, ... as :class:`~megatron_pg_agg.
    integrations.bridge.hf_model.HFShape`)."""

    def build_chunks(self, **settings) -> list:
        """This rank's megatron-core model chunks with the source's weights (collective)."""

    def save(self, model: list, out_dir: str, *, rank: int) -> str:
        """Write the live ``model`` back in the source's format to ``out_dir`` (collective)."""


def open_model_source(kind: str, path: str) -> ModelSource:
    """The source of ``kind`` at ``path``; raises :class:`ModelSourceError` (the source's own
    subclass where it refuses the path)."""
    found = importlib.metadata.entry_points(group=GROUP, name=kind)
    if not found:
        raise ModelSourceError(f"no model source {kind!r} is installed (entry-point group {GROUP!r}): reinstall "
                               "megatron_pg_agg (pip install -e .)")
    opener = next(iter(found)).load()
    return opener(path)

"""Host checks of a local Hugging Face causal-LM folder, and of the Megatron-Bridge install.

Everything here reads files and package metadata only (no torch, megatron-core or
Megatron-Bridge import), so a bad folder or a missing install is refused at start-up, before any
process group, with the file and the reason named.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from dataclasses import dataclass

from megatron_pg_agg.training.model_source import ModelSourceError

__all__ = ["BRIDGE_INSTALL", "HFFolder", "HFFolderError", "bridge_install_problem", "open_hf_folder"]

BRIDGE_INSTALL = ('pip install torch==2.14.1 && pip install --no-deps megatron-bridge==0.6.2 && '
                  'pip install -e ".[bridge]"')
"""The install line of the Megatron-Bridge path (Python 3.12; docs/hf-models.md says why ``--no-deps``)."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")
"""Files of a source folder copied into every HF folder the trainer writes, where present."""

WEIGHT_INDEX = "model.safetensors.index.json"


class HFFolderError(ModelSourceError):
    """A folder that is not a loadable HF causal LM (the message names the file and the reason)."""


@dataclass(frozen=True)
class HFFolder:
    """A checked HF causal-LM folder."""

    path: str
    """The folder (absolute)."""
    config: dict
    """``config.json`` as read."""
    architectures: tuple
    """``config["architectures"]``: every name ends in ``ForCausalLM``."""
    weight_files: tuple
    """The safetensors files holding the weights (absolute paths)."""
    tokenizer_files: tuple
    """The :data:`TOKENIZER_FILES` present (names)."""


def bridge_install_problem() -> str | None:
    """Why ``--hf-model`` / ``--save-hf`` cannot run in this interpreter, or None: Python 3.12 and
    the megatron-bridge distribution are needed (megatron-bridge 0.6 requires Python 3.12 and
    megatron-core 0.19)."""
    if sys.version_info[:2] != (3, 12):
        return (f"Hugging Face models go through Megatron-Bridge, which needs Python 3.12 (this is "
                f"{sys.version_info.major}.{sys.version_info.minor}); in a Python 3.12 venv: {BRIDGE_INSTALL}")
    try:
        importlib.metadata.version("megatron-bridge")
    except importlib.metadata.PackageNotFoundError:
        return f"megatron-bridge is not installed (Hugging Face models go through it); install: {BRIDGE_INSTALL}"
    return None


def open_hf_folder(path: str) -> HFFolder:
    """Check ``path`` is a local HF causal-LM folder: a ``config.json`` naming a ``*ForCausalLM``
    architecture, and safetensors weights (one ``model.safetensors``, or the shards an
    ``model.safetensors.index.json`` names, each present). Raises :class:`HFFolderError`."""
    if not os.path.isdir(path):
        raise HFFolderError(f"--hf-model {path}: no such directory (a local Hugging Face model folder; "
                            "nothing is downloaded from a hub)")
    path = os.path.abspath(path)
    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise HFFolderError(f"--hf-model {path}: no config.json (not a Hugging Face model folder)") from None
    except json.JSONDecodeError as err:
        raise HFFolderError(f"{config_path}: not valid JSON ({err})") from None
    architectures = tuple(config.get("architectures") or ())
    if not architectures or not all(a.endswith("ForCausalLM") for a in architectures):
        raise HFFolderError(f"{config_path}: architectures {list(architectures)} is not a causal LM "
                            "(a *ForCausalLM architecture is needed to train a policy)")
    index_path = os.path.join(path, WEIGHT_INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            names = sorted(set(json.load(f).get("weight_map", {}).values()))
        if not names:
            raise HFFolderError(f"{index_path}: empty weight_map")
        missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
        if missing:
            raise HFFolderError(f"{index_path} names weight files that are missing: {missing}")
        weight_files = tuple(os.path.join(path, n) for n in names)
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        weight_files = (os.path.join(path, "model.safetensors"),)
    else:
        found = sorted(n for n in os.listdir(path) if n.endswith((".bin", ".pt", ".pth")))
        hint = f" (found {found}: convert them to safetensors)" if found else ""
        raise HFFolderError(f"--hf-model {path}: no safetensors weights (model.safetensors or {WEIGHT_INDEX}){hint}")
    tokenizer = tuple(n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(path, n)))
    return HFFolder(path=path, config=config, architectures=architectures, weight_files=weight_files,
                    tokenizer_files=tokenizer)

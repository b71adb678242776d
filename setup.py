"""megatron_pg_agg: exact policy-gradient loss aggregation for Megatron-core RL training.

The top-level ``patches/`` folder (runtime patches of megatron-core, one module each) is shipped
as the subpackage ``megatron_pg_agg.patches``, its CPU stand-ins ``patches/cpu/`` as
``megatron_pg_agg.patches.cpu``.
"""
import re
from pathlib import Path

from setuptools import setup


def _versions_constant(name: str) -> str:
    """A string constant of megatron_pg_agg/versions.py, read as text: the package cannot be
    imported before its dependencies are installed. The package's version and the supported ranges
    are written there once."""
    text = (Path(__file__).parent / "megatron_pg_agg" / "versions.py").read_text()
    return re.search(rf'^{name} = "([^"]+)"', text, re.M).group(1)


# torch as a range (what every supported megatron-core release accepts), never a pin: pip must
# keep the torch a user already has (a CUDA build on a GPU node). The CPU wheel is pinned where
# the environment is made: the README's commands and .ci/run.
TORCH = _versions_constant("TORCH_REQUIREMENT")
MEGATRON_CORE = "megatron-core" + _versions_constant("SUPPORTED_MEGATRON_CORE")
MEGATRON_LM = ["six", "regex", "pyyaml", "pydantic", "psutil"]
# launch/train_rl_actor.py: what Megatron-LM's RL loop (megatron/rl, core_v0.19) imports at its top,
# beyond the pretrain path. megatron-core 0.19 needs Python 3.12, so the test extra takes them there.
MEGATRON_RL = ["wandb", "tqdm", "httpx", "openai", "fastapi", "uvicorn"]
# --hf-model / --save-hf (megatron_pg_agg.integrations.bridge.hf_model): what Megatron-Bridge 0.6.2 imports on
# the HF import/export path, installed after `pip install --no-deps megatron-bridge==0.6.2` (its full
# dependency set does not install from the index: docs/hf-models.md). Python 3.12 and megatron-core 0.19
# only, as megatron-bridge 0.6 itself.
BRIDGE = ["transformers>=5.8,<=5.12.1", "omegaconf", "einops", "safetensors", "nvidia-modelopt==0.47.0", "requests",
          # Megatron-Bridge's own training loop (launch/train_bridge_actor.py, integrations.bridge.loop)
          "datasets>=2.20", "megatron-energon~=7.0", "tensorboard>=2.19"]

# the verl plug-in (megatron_pg_agg.integrations.verl.plugin): what verl 0.9.1's Megatron engine imports,
# installed after `pip install --no-deps verl==0.9.1` (its full set pulls vllm/sglang/flash-attn builds:
# docs/verl.md), on top of the bridge extra (verl builds its model through Megatron-Bridge).
# transformers: verl 0.9.1 asks for <5.11, Megatron-Bridge 0.6.2 for >=5.8.
VERL = ["transformers>=5.8,<5.11", "tensordict==0.10.0", "hydra-core>=1.3.4,<1.4", "codetiming", "ray>=2.41",
        "peft>=0.18.1", "accelerate", "psutil", "pillow",
        # verl's v0 trainer module (the plug-in patches its _balance_batch: prompt groups whole per step)
        "torchdata", "cachetools"]

# the AReaL plug-in (megatron_pg_agg.integrations.areal.plugin): what AReaL 1.0.4's Megatron actor imports,
# installed after `pip install --no-deps areal==1.0.4 mbridge==0.15.1` (its full set is 80+ packages with
# sglang and CUDA builds: docs/areal.md), in a venv of its own (AReaL pins transformers<=5.3, Megatron-Bridge
# 0.6.2 needs >=5.8). hydra-core and omegaconf at AReaL's own pins.
AREAL = ["transformers==5.3.0", "hydra-core==1.4.0.dev1", "omegaconf==2.4.0.dev2", "aiofiles==25.1.0",
         "aiohttp==3.14.5", "colorlog==6.12.0", "datasets==5.2.0", "einops==0.8.2", "flask==3.1.3", "lark==1.3.1",
         "numba==0.68.1", "openai==3.57.0", "pybase64==1.5.1", "ray==2.60.0", "swanlab==0.6.12", "tabulate==0.10.0",
         "tenacity==9.2.1", "tensorboardx==2.6.5", "torchdata==0.11.0", "trackio==0.43.0", "uvloop==0.23.0",
         "wandb==0.31.0"]

setup(
    name="megatron_pg_agg",
    version=_versions_constant("PACKAGE_VERSION"),
    description="Exact policy-gradient loss aggregation (token/seq/prompt mean, constant) for Megatron-core",
    # listed, not found: tests/unit/test_packaging.py checks the list against the folders on disk
    packages=["megatron_pg_agg", "megatron_pg_agg.core", "megatron_pg_agg.data", "megatron_pg_agg.megatron",
              "megatron_pg_agg.training", "megatron_pg_agg.parity", "megatron_pg_agg.online",
              "megatron_pg_agg.integrations", "megatron_pg_agg.integrations.areal",
              "megatron_pg_agg.integrations.areal.cpu",
              "megatron_pg_agg.integrations.verl", "megatron_pg_agg.integrations.slime",
              "megatron_pg_agg.integrations.slime_family", "megatron_pg_agg.integrations.miles",
              "megatron_pg_agg.integrations.nemo_rl", "megatron_pg_agg.integrations.nemo_rl.cpu",
              "megatron_pg_agg.integrations.bridge", "megatron_pg_agg.integrations.bridge.cpu",
              "megatron_pg_agg.patches", "megatron_pg_agg.patches.cpu",
              "megatron_pg_agg.audit", "megatron_pg_agg.audit.hosts"],
    package_dir={"megatron_pg_agg": "megatron_pg_agg", "megatron_pg_agg.patches": "patches",
                 "megatron_pg_agg.patches.cpu": "patches/cpu"},
    python_requires=">=3.10",
    install_requires=[TORCH, MEGATRON_CORE, "numpy", "packaging"],
    extras_require={
        # tensorboard: the Megatron-LM tests read the event files Megatron-LM's writer makes
        # pytest-xdist: the README's test command and .ci/run run two test processes (-n 2)
        "test": ["pytest>=8", "pytest-xdist>=3", "hypothesis>=6", "matplotlib", "tensorboard", *MEGATRON_LM,
                 *(f"{p}; python_version >= '3.12'" for p in MEGATRON_RL)],
        # .ci/run's lint step (configuration in pyproject.toml)
        "lint": ["ruff>=0.15,<0.18"],
        # launch/pretrain_actor.py: what Megatron-LM's training side (a user's checkout, not a
        # package) imports on the pretrain path, plus psutil for its torch_dist checkpoints. No
        # triton on CPU: the megatron_lm_cpu patch stands in for the one module that imports it.
        "megatron-lm": MEGATRON_LM,
        "megatron-rl": MEGATRON_LM + MEGATRON_RL,
        "bridge": [f"{p}; python_version >= '3.12'" for p in BRIDGE],
        "verl": [f"{p}; python_version >= '3.12'" for p in (*BRIDGE, *VERL)
                 if not p.startswith("transformers>=5.8,<=")],  # VERL's narrower transformers range
        "areal": [f"{p}; python_version >= '3.12'" for p in AREAL],
        # the parity command's --plot
        "plot": ["matplotlib"],
        # GPU only: Transformer Engine needs CUDA. Never add NVIDIA apex here: the PyPI package
        # named "apex" is an unrelated web toolkit.
        "te": ["transformer-engine[pytorch]"],
    },
    entry_points={
        "console_scripts": ["megatron-pg-agg-parity=megatron_pg_agg.parity:main",
                            "megatron-pg-agg-audit=megatron_pg_agg.audit:main"],
        # verl loads every plug-in of this group on import (VERL_USE_EXTERNAL_PLUGINS=auto, its default):
        # the plug-in registers loss_mode "pg_agg" and patches verl's Megatron engine, inert until used
        "verl.plugins": ["megatron_pg_agg = megatron_pg_agg.integrations.verl.plugin"],
        # the trainer's --hf-model/--save-hf reach Megatron-Bridge through this seam
        # (megatron_pg_agg/training/model_source.py): the training layer imports no integration
        "megatron_pg_agg.model_sources": ["hf = megatron_pg_agg.integrations.bridge.hf_model:open_hf_model"],
    },
)

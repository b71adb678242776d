"""Make a tiny Hugging Face causal LM locally (no hub download): for the README's HF command and the tests.

    python -m megatron_pg_agg.integrations.bridge.tiny_hf --family qwen3 OUT_DIR [--seed 0] [--vocab-size 128]

Writes ``OUT_DIR`` with transformers' own ``save_pretrained`` (config.json, model.safetensors,
generation_config.json): 4 layers (``--num-layers``), hidden 64, 4 attention heads, 2 key/value heads, random weights
from ``--seed``. Families: :data:`FAMILIES` (Llama, Qwen2 with its q/k/v biases, Qwen3 with QK
layer norm, Qwen3-MoE with 4 experts, top-2). Needs transformers (the ``bridge`` extra).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
"""The families the tests cover; each is a different Megatron-Bridge mapping."""


def tiny_config(family: str, *, vocab_size: int = 128, tie: bool = False, num_layers: int = 4):
    """transformers' config of a tiny model of ``family``."""
    import transformers  # noqa: PLC0415  (an optional extra)

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=tie, rms_norm_eps=1e-6)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=16)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[],
                                           norm_topk_prob=True)
    raise ValueError(f"family {family!r}: one of {FAMILIES}")


def make_tiny_model(family: str, out_dir: str, *, seed: int = 0, vocab_size: int = 128, tie: bool = False,
                    num_layers: int = 4) -> str:
    """Write a tiny ``family`` model with seeded random weights to ``out_dir``; returns it. Like
    ``--save-hf``, it replaces only a folder it made before (:mod:`megatron_pg_agg.data.output_folder`):
    anything else at ``out_dir`` raises ``OutputFolderError`` and is left as it was."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from megatron_pg_agg.data.output_folder import (  # noqa: PLC0415
        TINY_HF_KIND,
        OutputFolderError,
        new_output_folder,
        output_folder_problem,
        replace_output_folder,
    )

    problems = output_folder_problem(out_dir, "tiny_hf", kind=TINY_HF_KIND)
    if problems:
        raise OutputFolderError("; ".join(problems))
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    hf_logging.disable_progress_bar()  # a one-file write needs no "Writing model shards" bar
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, vocab_size=vocab_size, tie=tie, num_layers=num_layers),
                                             dtype=torch.float32)
    temp = new_output_folder(out_dir)
    try:
        model.save_pretrained(temp)
        replace_output_folder(temp, os.path.abspath(out_dir), kind=TINY_HF_KIND, flag="tiny_hf")
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)  # our own hidden temporary folder only
        raise
    return out_dir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_pg_agg.integrations.bridge.tiny_hf",
                                     description="Make a tiny HF causal LM locally (no download).")
    parser.add_argument("out_dir")
    parser.add_argument("--family", choices=FAMILIES, default="qwen3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--tie-word-embeddings", action="store_true")
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401, PLC0415
    except ImportError:
        print("tiny_hf: transformers is not installed (pip install -e '.[bridge]' on Python 3.12)", file=sys.stderr)
        return 2
    from megatron_pg_agg.data.output_folder import OutputFolderError  # noqa: PLC0415

    try:
        out = make_tiny_model(args.family, args.out_dir, seed=args.seed, vocab_size=args.vocab_size,
                              tie=args.tie_word_embeddings, num_layers=args.num_layers)
    except OutputFolderError as error:
        print(f"tiny_hf: refusing to write: {error}", file=sys.stderr)
        return 2
    print(f"tiny_hf: wrote a {args.family} model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

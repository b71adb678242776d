"""Make a tiny Hugging Face causal LM locally (no hub download): for the README's HF command and the tests.

    python -m megatron_pg_agg.integrations.tiny_hf --family qwen3 OUT_DIR [--seed 0] [--vocab-size 128]

Writes ``OUT_DIR`` with transformers' own ``save_pretrained`` (config.json, model.safetensors,
generation_config.json): 4 layers (``--num-layers``), hidden 64, 4 attention heads, 2 key/value heads, random weights
from ``--seed``. Families: :data:`FAMILIES` (Llama, Qwen2 with its q/k/v biases, Qwen3 with QK
layer norm, Qwen3-MoE with 4 experts, top-2). Needs transformers (the ``bridge`` extra).
"""
from __future__ import annotations

import argparse
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
    """Write a tiny ``family`` model with seeded random weights to ``out_dir``; returns it."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, vocab_size=vocab_size, tie=tie, num_layers=num_layers),
                                             dtype=torch.float32)
    model.save_pretrained(out_dir)
    return out_dir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_pg_agg.integrations.tiny_hf",
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
    out = make_tiny_model(args.family, args.out_dir, seed=args.seed, vocab_size=args.vocab_size,
                          tie=args.tie_word_embeddings, num_layers=args.num_layers)
    print(f"tiny_hf: wrote a {args.family} model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

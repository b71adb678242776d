"""megatron-core's known silent bugs that this project's paths could meet, refused at start-up.

Megatron-LM #7452 ("Silent numerical-correctness bugs in Megatron Core parallelism composition",
2026-09) lists findings whose fixes are open PRs on every release we support (0.15-0.19). Most
cannot occur on our paths (docs/failure-modes.md has the table, finding by finding); the ones a
user can reach through Megatron-LM's own flags or a Megatron-Bridge recipe are refused here, by
the configuration value that enables them, before any model is built:

- finding 8: a learnable attention sink (``softmax_type="learnable"``) under TP > 1. Its
  ``softmax_offset`` is head-sharded but not marked tensor-parallel, so the grad norm, and with it
  gradient clipping, counts only TP rank 0's sinks (fix PR #7530, open);
- finding 11: the experimental attention variants (``experimental_attention_variant``, gated
  delta net): GatedDeltaNet's ``out_norm`` gradient is not summed over TP without SP; our packed
  THD attention is verified for dot-product attention only;
- finding 12: Megatron-FSDP (``use_megatron_fsdp``): a checkpoint saved at one PP size loads the
  wrong layers at another, silently (strict load succeeds).

Not in #7452 but of the same kind: torch FSDP2 (``use_torch_fsdp2``), whose wrapper never scales the
gradients by the step's token count (:data:`~megatron_pg_agg.megatron.config_checks.TORCH_FSDP2_REASON`).

One function, :func:`known_bug_problems`, takes the values by name, so each entry (Megatron-LM's
raw command line, a Bridge ``ConfigContainer``) passes what it holds and names the setting its own way.
"""
from __future__ import annotations

from typing import Optional

from megatron_pg_agg.megatron.config_checks import TORCH_FSDP2_REASON

ISSUE = "Megatron-LM #7452"


def known_bug_problems(*, softmax_type: Optional[str], tensor_model_parallel_size: int,
                       experimental_attention_variant: Optional[str], use_megatron_fsdp: bool,
                       use_torch_fsdp2: bool, names: dict) -> list:
    """One message per setting that meets a known silent bug; empty when none does. ``names``
    maps each keyword above to how the caller's user spells it (``"--softmax-type"``,
    ``"cfg.model.softmax_type"``)."""
    problems = []
    if softmax_type == "learnable" and tensor_model_parallel_size > 1:
        problems.append(
            f"{names['softmax_type']} learnable with {names['tensor_model_parallel_size']} "
            f"{tensor_model_parallel_size}: megatron-core does not mark the attention sinks' softmax_offset as "
            f"tensor-parallel, so the grad norm and gradient clipping count only TP rank 0's sinks ({ISSUE}, "
            "finding 8; fix PR #7530, open). Use tensor parallel size 1 with learnable sinks, or another "
            "softmax type.")
    if experimental_attention_variant:
        problems.append(
            f"{names['experimental_attention_variant']} {experimental_attention_variant}: GatedDeltaNet's out_norm "
            f"gradient is not summed over TP without sequence parallelism ({ISSUE}, finding 11), and the packed "
            "THD attention of this project is verified for dot-product attention only. Drop the flag.")
    if use_megatron_fsdp:
        problems.append(
            f"{names['use_megatron_fsdp']}: a Megatron-FSDP checkpoint saved at one pipeline size loads the wrong "
            f"layers at another without an error ({ISSUE}, finding 12), and the per-token loss contract is verified "
            "with megatron-core's DDP only. Use the default DDP (optionally --use-distributed-optimizer).")
    if use_torch_fsdp2:
        problems.append(f"{names['use_torch_fsdp2']}: {TORCH_FSDP2_REASON}.")
    return problems


MEGATRON_LM_NAMES = {"softmax_type": "--softmax-type", "tensor_model_parallel_size": "--tensor-model-parallel-size",
                     "experimental_attention_variant": "--experimental-attention-variant",
                     "use_megatron_fsdp": "--use-megatron-fsdp", "use_torch_fsdp2": "--use-torch-fsdp2"}
"""How Megatron-LM's command line names each setting."""


def bridge_recipe_problems(cfg) -> list:
    """:func:`known_bug_problems` of a Megatron-Bridge ``ConfigContainer``."""
    model = cfg.model
    return known_bug_problems(
        softmax_type=getattr(model, "softmax_type", None),
        tensor_model_parallel_size=getattr(model, "tensor_model_parallel_size", 1) or 1,
        experimental_attention_variant=getattr(model, "experimental_attention_variant", None),
        use_megatron_fsdp=bool(getattr(cfg.ddp, "use_megatron_fsdp", False)),
        use_torch_fsdp2=bool(getattr(cfg.dist, "use_torch_fsdp2", False)),
        names={"use_torch_fsdp2": "cfg.dist.use_torch_fsdp2", "softmax_type": "cfg.model.softmax_type",
               "tensor_model_parallel_size": "cfg.model.tensor_model_parallel_size",
               "experimental_attention_variant": "cfg.model.experimental_attention_variant",
               "use_megatron_fsdp": "cfg.ddp.use_megatron_fsdp"})

"""Runtime patches of megatron-core, one small module per patch (shipped as megatron_pg_agg.patches).

Every patch is a :class:`~megatron_pg_agg.patches._machinery.Patch`: it names the megatron-core
releases it supports, checks the installed release and resolves every target *before* touching
anything, wraps (never copies) the upstream functions, is idempotent and can be reverted exactly.

Every patch supports megatron-core 0.15.x to 0.19.x (``megatron_pg_agg.versions``); a target that
exists only in some releases names its own range (``Target.releases``).

The folder shows which modules can change a run and which only make CPU runs possible: the
device patches and the machinery are at the top, the CPU stand-ins in ``patches/cpu``
(``megatron_pg_agg.patches.cpu``).

Patches that can change a run (any device)
    ``megatron_lm_log`` (:mod:`.megatron_lm_log`), with the Megatron-LM checkout of the installed
    megatron-core's minor release (:mod:`._megatron_lm_release`): wraps Megatron-LM's
    ``training_log`` to hand each iteration's reduced report to registered observers (its console
    drops values that are not > 0).
    ``moe_aux_loss`` (:mod:`.moe_aux_loss`): MoE router aux/z losses keep Megatron's
    default strength under ``calculate_per_token_loss`` (token multiply off, a per-step factor
    ``W / M_total`` set by :func:`.moe_aux_loss.set_moe_aux_loss_scale`).
    ``mtp_loss`` (:mod:`.mtp_loss`): the multi-token-prediction loss is a token mean over the
    step's valid response tokens in every mode (a per-step factor ``W / D`` set by
    :func:`.mtp_loss.set_mtp_loss_scale`, 0.17+'s local count ratio neutralised, packed
    sequences rolled within their padded slots). megatron-core 0.16 to 0.19.
    ``megatron_rl`` (:mod:`.megatron_rl`), Megatron-LM core_v0.19.x: the RL loop's rollout and
    collection seams (the RL entry's replayed rollouts and planner), ``fp32_output`` dropped
    where ``GPTModel.forward`` lacks it, no hard exit when no inference engine ran.
    ``rope_thd`` (:mod:`.rope_thd`), megatron-core 0.19.x: the unfused RoPE of packed (THD)
    sequences in one shot, as 0.15 to 0.18 do, instead of 0.19's one autograd chain per sequence
    (same values; every other case goes to upstream). The entries apply it where
    :func:`.rope_thd.needed`.
    The machinery: :mod:`._machinery` (the :class:`Patch` mechanism), :mod:`._megatron_lm_release`
    (a Megatron-LM checkout's release), :mod:`._step_factor` (the per-step factors' shared pieces).

CPU stand-ins (patches/cpu: CPU-only, each refuses to apply where CUDA is available)
    ``cpu_gloo`` (:mod:`.cpu.cpu_gloo`): runs schedules, DDP,
    tensor-parallel layers and GPTModel on CPU with gloo by redirecting megatron-core's CUDA
    buffers, synchronisation, causal mask, RNG tracker and ``Tensor.cuda()`` (tied embeddings,
    PP > 1) to the CPU. Targets and reasons are listed in its module docstring.
    ``optimizer_cpu`` (:mod:`.cpu.optimizer_cpu`): megatron-core's mixed-precision (``--bf16``) and
    distributed (``--use-distributed-optimizer``) optimizers on CPU (the CUDA type strings they sort
    parameters by); the trainer and the Megatron-LM entries apply it on CPU.
    ``megatron_lm_cpu`` (:mod:`.cpu.megatron_lm_cpu`), same checkout check as ``megatron_lm_log``:
    lets Megatron-LM's own ``pretrain()`` run on CPU (device-'cuda' counters, streams, memory
    stats, ``Module.cuda()``, nvcc/make builds, the JIT warm-up, and a stand-in for the one
    triton-importing module).
    ``megatron_rl_cpu`` (:mod:`.cpu.megatron_rl_cpu`): the RL loop's data path on CPU.
    :mod:`.cpu.cpu_torch`: the CPU proxies of ``torch`` these patches put in a module's namespace
    (the hosts' stand-ins use them too).

The hosts' own patches and CPU stand-ins (verl's engine, AReaL's actor, Megatron-Bridge, NeMo-RL) live
with their plug-ins in ``megatron_pg_agg.integrations.<host>``; each host folder applies them through
:func:`._machinery.apply`, and :func:`revert_megatron_patches` reverts them with the rest. Nothing here
imports a host.

Usage::

    from megatron_pg_agg.patches import apply_megatron_patches, revert_megatron_patches
    apply_megatron_patches()          # -> ["cpu_gloo"]
    ...
    revert_megatron_patches()         # -> ["cpu_gloo"]
"""
from __future__ import annotations

from . import _machinery, megatron_lm_log, megatron_rl, moe_aux_loss, mtp_loss, rope_thd
from ._machinery import Patch, Target, is_applied
from .cpu import cpu_gloo, megatron_lm_cpu, megatron_rl_cpu, optimizer_cpu

__all__ = [
    "PATCHES",
    "Patch",
    "Target",
    "apply_megatron_patches",
    "applied_patches",
    "is_applied",
    "revert_megatron_patches",
]

PATCHES: dict[str, Patch] = {
    cpu_gloo.NAME: cpu_gloo.PATCH,
    optimizer_cpu.NAME: optimizer_cpu.PATCH,
    megatron_lm_cpu.NAME: megatron_lm_cpu.PATCH,
    megatron_lm_log.NAME: megatron_lm_log.PATCH,
    moe_aux_loss.NAME: moe_aux_loss.PATCH,
    mtp_loss.NAME: mtp_loss.PATCH,
    megatron_rl.NAME: megatron_rl.PATCH,
    megatron_rl_cpu.NAME: megatron_rl_cpu.PATCH,
    rope_thd.NAME: rope_thd.PATCH,
}
"""Every known patch, by name, in application order."""


def apply_megatron_patches(*, cpu_gloo: bool = True, optimizer_cpu: bool = False, megatron_lm_cpu: bool = False,
                           megatron_lm_log: bool = False, moe_aux_loss: bool = False,
                           mtp_loss: bool = False, megatron_rl: bool = False,
                           megatron_rl_cpu: bool = False, rope_thd: bool = False) -> list[str]:
    """Apply the selected patches; return the names applied by this call (already applied: no-op).

    Each patch checks the megatron-core version (and, for the Megatron-LM ones, the checkout's
    release) and its targets before touching anything, so a failure raises ``RuntimeError`` with
    megatron-core and Megatron-LM unchanged by that patch.
    """
    wanted = {"cpu_gloo": cpu_gloo, "optimizer_cpu": optimizer_cpu, "megatron_lm_cpu": megatron_lm_cpu,
              "megatron_lm_log": megatron_lm_log,
              "moe_aux_loss": moe_aux_loss, "mtp_loss": mtp_loss, "megatron_rl": megatron_rl,
              "megatron_rl_cpu": megatron_rl_cpu, "rope_thd": rope_thd}
    return _machinery.apply_in_order(patch for name, patch in PATCHES.items() if wanted[name])


def revert_megatron_patches() -> list[str]:
    """Revert every applied patch (newest first); return the names reverted."""
    return [name for name in reversed(_machinery.applied()) if _machinery.revert(name)]


def applied_patches() -> list[str]:
    """Names of the patches currently applied, in application order."""
    return _machinery.applied()

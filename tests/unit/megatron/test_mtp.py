"""Multi-token prediction under the mtp_loss patch, on the installed release's real GPTModel, MTP
block and forward-backward schedule (one gloo rank, CPU, several microbatches per step).

The reference is Megatron's own token-mean run with the policy-gradient loss switched off: the
same weights and microbatches, the mtp_loss patch reverted, and a loss function that returns
``(0 * logits, D_mb)``, so ``finalize_model_grads`` divides by the step's valid tokens ``D`` and
the MTP parameters' gradient is exactly megatron-core's ``(f / K) sum_k sum_t d_k grad CE_k / D``
(every prompt here has at least K + 1 tokens, so 0.17+'s local count ratio is 1 there). The
parameters of the MTP block (``mtp.*``) get no gradient from the main head, so theirs is the MTP
term alone and can be compared in every mode.
"""
from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads

from megatron_pg_agg.core.losses import PGLossConfig
from megatron_pg_agg.core.modes import MODES
from megatron_pg_agg.data.planner import PlanConfig, plan_step
from megatron_pg_agg.megatron.layout import ParallelSizes
from megatron_pg_agg.megatron.loss_func import forward_microbatch, run_schedule
from megatron_pg_agg.megatron.model import build_model_chunks, wrap_in_ddp
from megatron_pg_agg.megatron.parallel import init_distributed, init_parallel, teardown_parallel
from megatron_pg_agg.megatron.step import StepGroups, run_pg_step
from megatron_pg_agg.parity.models import tiny_transformer_config
from megatron_pg_agg.patches import apply_megatron_patches, is_applied, mtp_loss, revert_megatron_patches
from megatron_pg_agg.versions import in_range, installed_megatron_core_version
from tests.support.rollouts import VOCAB, fixed_step

K, FACTOR = 2, 0.3
pytestmark = pytest.mark.skipif(not in_range(installed_megatron_core_version(), mtp_loss.SUPPORTED),
                                reason="megatron-core 0.15 refuses MTP on packed sequences (tested separately)")


@pytest.fixture(scope="module")
def model():
    revert_megatron_patches()
    apply_megatron_patches(cpu_gloo=True, mtp_loss=True)
    owns_group = not dist.is_initialized()
    init_distributed()
    init_parallel(ParallelSizes(), seed=5)
    config = tiny_transformer_config(num_layers=2, mtp_num_layers=K, mtp_loss_scaling_factor=FACTOR,
                                     calculate_per_token_loss=True)
    config.finalize_model_grads_func = finalize_model_grads
    torch.manual_seed(5)
    chunks = wrap_in_ddp(build_model_chunks(config, VOCAB, 128, share_embeddings_and_output_weights=True), config)
    assert any(n.startswith("mtp.") for n, _ in chunks[0].module.named_parameters())
    yield chunks
    mtp_loss.clear_mtp_loss_scale()
    teardown_parallel()
    if owns_group:
        dist.destroy_process_group()
    revert_megatron_patches()
    apply_megatron_patches()


def _rollouts():
    """The fixed ragged step, every prompt lengthened to at least K + 1 tokens."""
    rollouts = fixed_step()
    for r in rollouts:
        r.prompt_ids = [3] * K + list(r.prompt_ids)
    return rollouts


def _loss_cfg(mode: str) -> PGLossConfig:
    return PGLossConfig(mode=mode, divisor=16.0 if mode == "constant" else None)


def _mtp_grads(chunks) -> torch.Tensor:
    return torch.cat([p.main_grad.flatten().double() for n, p in chunks[0].module.named_parameters()
                      if n.startswith("mtp.")])


def _ours(chunks, mode: str, plan_cfg: PlanConfig):
    plan = plan_step(_rollouts(), _loss_cfg(mode), plan_cfg)
    result = run_pg_step(chunks, plan, _loss_cfg(mode), StepGroups.from_parallel_state(), dp_rank=0)
    return _mtp_grads(chunks), result, plan


def _token_mean_loss(mb, output_tensor):
    """Megatron's SFT-style contract with the PG loss off: no loss, the microbatch's valid tokens."""
    return (output_tensor * 0.0).sum(), mb.denominator_mask.sum().to(torch.int), {}


def _megatron_token_mean(chunks, plan_cfg: PlanConfig):
    """The MTP gradient of Megatron's own token-mean run (mtp_loss patch reverted)."""
    plan = plan_step(_rollouts(), _loss_cfg("token_mean"), plan_cfg)
    revert_megatron_patches()
    apply_megatron_patches(cpu_gloo=True)
    try:
        for chunk in chunks:
            chunk.zero_grad_buffer()

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            return forward_microbatch(model, mb), partial(_token_mean_loss, mb)

        run_schedule(chunks, plan.for_rank(0), forward_step)
        return _mtp_grads(chunks), plan
    finally:
        revert_megatron_patches()
        apply_megatron_patches(cpu_gloo=True, mtp_loss=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


UNPADDED = PlanConfig(dp_size=1, num_microbatches=3)


def test_every_mode_gives_megatrons_token_mean_mtp_gradient(model):
    """In token_mean, seq_mean, prompt_mean and constant the MTP parameters' gradient equals
    Megatron's own token-mean run's (3 microbatches). Catches: the step factor W / D missing
    (seq_mean then D / W = 7.4x too strong), applied twice, or set from a per-microbatch count;
    0.17+'s local count ratio not neutralised (the plain sum is what both runs attach here, so
    that alone is caught by the W = 0 and factor tests below)."""
    reference, plan = _megatron_token_mean(model, UNPADDED)
    assert float(reference.norm()) > 0
    for mode in MODES:
        ours, result, ours_plan = _ours(model, mode, UNPADDED)
        assert ours_plan.totals.valid_tokens == plan.totals.valid_tokens
        assert _rel(ours, reference) <= 1e-5, (mode, _rel(ours, reference))


def test_control_unpatched_strength_is_off_by_the_predicted_factor(model):
    """Without the patch (megatron-core as released) under seq_mean the MTP gradient is divided by
    W (active sequences) instead of D (valid tokens): D / W times ours, as predicted. Under
    token_mean W = D and the two agree, so the factor is the mode's doing."""
    ours, _, plan = _ours(model, "seq_mean", UNPADDED)
    revert_megatron_patches()
    apply_megatron_patches(cpu_gloo=True)
    try:
        from megatron_pg_agg.megatron.loss_func import make_forward_step

        for chunk in model:
            chunk.zero_grad_buffer()
        run_schedule(model, plan.for_rank(0), make_forward_step(_loss_cfg("seq_mean"), plan.totals))
        unpatched = _mtp_grads(model)
    finally:
        revert_megatron_patches()
        apply_megatron_patches(cpu_gloo=True, mtp_loss=True)
    predicted = plan.totals.valid_tokens / plan.totals.pg_weight
    assert predicted > 5  # the modes differ here: 7.4 valid tokens per active sequence
    measured = float(unpatched.norm() / ours.norm())
    assert measured == pytest.approx(predicted, rel=1e-5)
    assert _rel(unpatched, ours * predicted) <= 1e-5
    print(f"unpatched / patched MTP gradient under seq_mean: {measured:.6f} (D / W = {predicted:.6f})")


def _short_prompt_rollouts():
    """The fixed step with every prompt cut to 1 token (fewer than K + 1): each response's first
    labels fall off its depth-k roll, so a microbatch's rolled count is below its count."""
    rollouts = fixed_step()
    for r in rollouts:
        r.prompt_ids = list(r.prompt_ids[:1])
    return rollouts


@pytest.mark.skipif(not in_range(installed_megatron_core_version(), ">=0.17"),
                    reason="process_mtp_loss and its local count ratio exist from megatron-core 0.17")
def test_short_prompts_give_one_mtp_gradient_however_the_step_is_cut(model):
    """Megatron-LM #7452 finding 3 (#3159): 0.17+'s process_mtp_loss scales each microbatch's
    MTP loss by that microbatch's count / rolled count, so with prompts shorter than K + 1 tokens
    the MTP gradient depends on how the step is cut. Under the patch one microbatch and four
    uneven ones give the same gradient; as released (patch reverted, token_mean and no padding,
    where the patch's step factor and roll fix change nothing) they differ by the local ratios.
    Catches the process_mtp_loss or roll_tensor count wrapper dropped."""
    def mtp_grads(num_microbatches: int, patched: bool):
        plan = plan_step(_short_prompt_rollouts(), _loss_cfg("token_mean"),
                         PlanConfig(dp_size=1, num_microbatches=num_microbatches))
        assert len(plan.for_rank(0)) == num_microbatches
        if not patched:
            revert_megatron_patches()
            apply_megatron_patches(cpu_gloo=True)
        try:
            for chunk in model:
                chunk.zero_grad_buffer()
            if patched:
                run_pg_step(model, plan, _loss_cfg("token_mean"), StepGroups.from_parallel_state(), dp_rank=0)
            else:
                from megatron_pg_agg.megatron.loss_func import make_forward_step

                run_schedule(model, plan.for_rank(0), make_forward_step(_loss_cfg("token_mean"), plan.totals))
            return _mtp_grads(model)
        finally:
            if not patched:
                revert_megatron_patches()
                apply_megatron_patches(cpu_gloo=True, mtp_loss=True)

    whole, cut = mtp_grads(1, patched=True), mtp_grads(4, patched=True)
    assert float(whole.norm()) > 0 and _rel(cut, whole) <= 1e-5, _rel(cut, whole)
    released_whole, released_cut = mtp_grads(1, patched=False), mtp_grads(4, patched=False)
    assert _rel(released_cut, released_whole) > 1e-3, _rel(released_cut, released_whole)
    print(f"MTP gradient, 4 microbatches against 1: patched {_rel(cut, whole):.1e}, "
          f"as released {_rel(released_cut, released_whole):.1e}")


def test_the_mtp_layers_tensor_parallel_group_is_the_global_one(model):
    """Megatron-LM #7452 finding 4: MTP's full recompute (fp8/fp4) communicates on
    parallel_state's global TP group instead of the layer's own. This project builds every model
    on the one global process grid, so the two are the same group and the finding cannot change a
    result here. Catches a model built with a process-group collection of its own."""
    from megatron.core import parallel_state

    layers = [m for n, m in model[0].module.named_modules() if n.startswith("mtp") and getattr(m, "tp_group", None)]
    if not layers:
        pytest.skip("this release's MTP layers keep no TP group of their own (they use the global one)")
    assert all(m.tp_group is parallel_state.get_tensor_model_parallel_group() for m in layers)


def test_padded_sequences_roll_within_their_slots(model):
    """Sequences padded to a multiple of 4 (what SP / CP / pipeline buffers do) give the
    unpadded token-mean gradient: each sequence is rolled within its padded slot. Without the
    roll fix megatron-core rolls on the real lengths and moves labels across sequences."""
    padded = PlanConfig(dp_size=1, num_microbatches=3, tp_size=4, sequence_parallel=True)
    plan = plan_step(_rollouts(), _loss_cfg("seq_mean"), padded)
    assert any(not torch.equal(mb.cu_seqlens, mb.cu_seqlens_padded) for mb in plan.for_rank(0))
    reference, _ = _megatron_token_mean(model, UNPADDED)
    ours, _, _ = _ours(model, "seq_mean", padded)
    assert _rel(ours, reference) <= 1e-5


def test_roll_of_a_padded_pack_stays_in_each_slot():
    """roll_tensor on two sequences of real lengths 3 and 5 padded to 4 and 6: under the patch
    each rolls within its slot; as released it crosses into the next sequence."""
    import megatron.core.transformer.multi_token_prediction as mtp_module
    from megatron.core.packed_seq_params import PackedSeqParams

    real, slots = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 4, 10], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=slots,
                             cu_seqlens_kv_padded=slots, max_seqlen_q=5, max_seqlen_kv=5)
    x = torch.arange(1, 11, dtype=torch.float32)[None]
    within_slots = [2, 3, 4, 0, 6, 7, 8, 9, 10, 0]  # written here: each slot shifted left, its end 0
    assert is_applied("mtp_loss")
    rolled, _ = mtp_module.roll_tensor(x, shifts=-1, dims=-1, cp_group=None, packed_seq_params=params)
    assert rolled[0].tolist() == within_slots
    revert_megatron_patches()
    try:
        released, _ = mtp_module.roll_tensor(x, shifts=-1, dims=-1, cp_group=None, packed_seq_params=params)
        assert released[0].tolist() != within_slots
    finally:
        apply_megatron_patches(cpu_gloo=True, mtp_loss=True)


def test_a_step_without_valid_tokens_has_zero_mtp_gradient(model):
    """W = 0 (every response token masked): D = 0, the factor is 0, every MTP gradient is exactly
    0 and nothing is NaN. Catches a factor W / max(D, 1) mistaken for 1, or a 0 / 0."""
    rollouts = _rollouts()
    for r in rollouts:
        r.loss_mask = [0] * len(r.loss_mask)
        r.numerator_mask = None
    plan = plan_step(rollouts, _loss_cfg("seq_mean"), UNPADDED)
    assert plan.totals.pg_weight == plan.totals.valid_tokens == 0
    result = run_pg_step(model, plan, _loss_cfg("seq_mean"), StepGroups.from_parallel_state(), dp_rank=0)
    grads = _mtp_grads(model)
    assert torch.equal(grads, torch.zeros_like(grads))
    assert result.values(0)["mtp_loss"] == [0.0, 0.0]


def test_the_reported_mtp_loss_is_megatrons_per_depth_token_mean(model):
    """One microbatch: megatron-core's own tracker holds, per depth, sum d_k CE_k / N_k (N_k = D
    here) in the released per-token run; the step's reported mtp_loss is their mean over depths.
    Catches the report divided by the wrong count, by f / K instead of f, or summed over depths."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    one = PlanConfig(dp_size=1, num_microbatches=1)
    _, result, plan = _ours(model, "prompt_mean", one)
    total, count = result.values(plan.totals.pg_weight)["mtp_loss"]
    assert count == plan.totals.valid_tokens
    reported = total / count
    assert not MTPLossLoggingHelper.tracker  # emptied by the report (Megatron-LM's own log is replaced)
    _megatron_token_mean(model, one)
    tracker = MTPLossLoggingHelper.tracker
    per_depth = (tracker.get("loss_values") if "loss_values" in tracker else tracker["values"]).double()
    tracker.clear()
    assert per_depth.shape == (K,) and bool((per_depth > 0).all())
    assert reported == pytest.approx(float(per_depth.mean()), rel=1e-5)


def test_an_mtp_loss_without_a_step_factor_is_refused(model):
    """The patch refuses to attach an MTP loss when no factor was set for the step (its gradient
    would silently be 1 / W)."""
    mtp_loss.clear_mtp_loss_scale()
    plan = plan_step(_rollouts(), _loss_cfg("seq_mean"), UNPADDED)
    from megatron_pg_agg.megatron.loss_func import make_forward_step

    for chunk in model:
        chunk.zero_grad_buffer()
    with pytest.raises(RuntimeError, match="no step factor is set"):
        run_schedule(model, plan.for_rank(0), make_forward_step(_loss_cfg("seq_mean"), plan.totals))

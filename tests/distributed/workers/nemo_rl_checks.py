"""NeMo-RL's own Megatron training path with the plug-in, on CPU (gloo): every case of one launch.

    MEGATRON_PG_AGG_NEMO_RL=/path/to/NeMo-RL \\
        torchrun --standalone --nproc-per-node {1,2} -m tests.distributed.workers.nemo_rl_checks OUT_DIR

One world size per launch: 1 rank runs DP 1; 2 ranks run DP 2, then DP 1 x CP 2
(``initialize_model_parallel`` again between them; NeMo-RL runs CP with sequence packing only).
Per case, what a GRPO step does with the plug-in on: the driver's ``Policy.train`` (here a local
stand-in with its signature, wrapped by ``use_pg_agg`` like NeMo-RL's) receives the batch, the
plug-in adds its fields over each optimizer step, NeMo-RL's ``shard_by_batch_size`` cuts it for the
DP ranks (fixed micro-batches, dynamic batching or sequence packing: ``Policy._shard_for_train``'s
arguments), and NeMo-RL's ``MegatronPolicyWorkerImpl`` (built without Ray: only the attributes its
methods read) trains it: ``train()`` (``process_global_batch``, ``get_microbatch_iterator``,
``LossPostProcessor`` with or without ``SequencePackingLossWrapper``, ``megatron_forward_backward``
in megatron-core 0.19.2's schedule, DDP, ``optimizer.step()``: 2 optimizer steps), or the split path
(``begin_train_step`` / ``train_microbatch`` / ``finish_train_step`` per step).

Stand-ins: the CPU patches of ``megatron_pg_agg.integrations.nemo_rl.cpu`` (each CPU-only), and
for CP the core attention ``CpThdDotProductAttention`` (packed THD without Transformer Engine).
The model: megatron-core's GPTModel, local spec, 2 layers, hidden 64, vocab 128, float32.

Per case and optimizer step the worker records, in ``OUT_DIR/<layout>__<case>.pt`` (rank 0): the
objective NeMo-RL reports (``global_loss``), the gradient it back-propagated (DDP's ``main_grad`` just
before ``optimizer.step()``, every parameter) and the weights it was computed at; the reference
(``tests/distributed/workers/nemo_rl_reference.py``, one process, float64) recomputes both.
"""
from __future__ import annotations

import json
import os
import sys
import time
import types

T0 = time.monotonic()
CHECKOUT = os.path.abspath(os.environ["MEGATRON_PG_AGG_NEMO_RL"])
sys.path.insert(0, CHECKOUT)

VOCAB, HIDDEN, HEADS, LAYERS = 128, 64, 4, 2
GROUPS, GROUP_SIZE, STEPS = 4, 4, 2
GBS = GROUPS * GROUP_SIZE // STEPS
MODES = {"token_mean": None, "seq_mean": None, "prompt_mean": None, "constant": 10.0}
SPLITS = ("fixed", "dynamic", "packing")
MB_TOKENS = 40
LOSS = dict(ratio_clip_min=0.2, ratio_clip_max=0.28, reference_policy_kl_penalty=0.01, reference_policy_kl_type="k3",
            use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
            truncated_importance_sampling_ratio=1.03)
"""NeMo-RL's PPO with its KL term (token level) and truncated importance sampling, in every case."""


def cases(cp: int) -> list:
    """``(name, mode, split, path, kind, loss keys)``: the plug-in in every mode under every split
    (``train()``), its split path, the controls (NeMo-RL's stock loss), and the MoE aux-only steps.
    With CP the split is sequence packing (NeMo-RL requires it)."""
    splits = ("packing",) if cp > 1 else SPLITS
    out = [(f"{mode}-{split}", mode, split, "train", "plugin", LOSS) for mode in MODES for split in splits]
    out += [(f"{mode}-packing-split_path", mode, "packing", "split", "plugin", LOSS) for mode in MODES]
    seq_level = {**LOSS, "token_level_loss": False}
    out += [("stock_token_level-packing", None, "packing", "train", "stock", LOSS),
            ("stock_sequence_level-packing", None, "packing", "train", "stock", seq_level),
            ("seq_mean_gspo-packing", "seq_mean", "packing", "train", "plugin",
             {**seq_level, "sequence_level_importance_ratios": True, "use_importance_sampling_correction": False,
              "truncated_importance_sampling_type": None, "truncated_importance_sampling_ratio": None}),
            ("seq_mean_gspo-packing-split_path", "seq_mean", "packing", "split", "plugin",
             {**seq_level, "sequence_level_importance_ratios": True, "use_importance_sampling_correction": False,
              "truncated_importance_sampling_type": None, "truncated_importance_sampling_ratio": None})]
    if cp == 1:  # the MoE router's aux loss alone (advantages 0, no KL): NeMo-RL's two paths and modes
        aux = {"ratio_clip_min": 0.2, "ratio_clip_max": 0.2, "reference_policy_kl_penalty": 0.0}
        out += [(f"moe-{name}", mode, "fixed", path, kind, {**aux, **extra}) for name, mode, path, kind, extra in (
            ("token_mean", "token_mean", "train", "plugin", {}),
            ("seq_mean", "seq_mean", "train", "plugin", {}),
            ("seq_mean-split_path", "seq_mean", "split", "plugin", {}),
            ("stock_token_level", None, "train", "stock", {}),
            ("stock_sequence_level", None, "train", "stock", {"token_level_loss": False}),
            ("stock_sequence_level-split_path", None, "split", "stock", {"token_level_loss": False}))]
    return out


# ---------------------------------------------------------------- model and NeMo-RL's objects
def build(cp: int, split: str, moe: bool, seed: int = 1234):
    """GPTModel + megatron-core DDP with NeMo-RL's settings (``calculate_per_token_loss``,
    ``average_in_collective=False``), Adam, the LR scheduler, and the model-config hooks Megatron-Bridge
    binds (``_update_model_config_funcs``, as NeMo-RL's set-up does)."""
    import torch
    from megatron.bridge.training.setup import _update_model_config_funcs
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = model_config(cp, moe)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    if cp > 1:
        from megatron_pg_agg.integrations.nemo_rl.cpu.te_cp_thd_attention import CpThdDotProductAttention

        spec.submodules.self_attention.submodules.core_attention = CpThdDotProductAttention
    elif split == "packing":
        from megatron_pg_agg.megatron.thd_attention import ThdDotProductAttention

        spec.submodules.self_attention.submodules.core_attention = ThdDotProductAttention
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=64,
                     share_embeddings_and_output_weights=True, position_embedding_type="rope")
    ddp = DistributedDataParallelConfig(check_for_nan_in_grad=True, grad_reduce_in_fp32=False,
                                        average_in_collective=False, use_distributed_optimizer=False)
    model = DistributedDataParallel(config=config, ddp_config=ddp, module=model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0, clip_grad=0.0,
                                                       params_dtype=torch.float32), [model])
    scheduler = OptimizerParamScheduler(optimizer, init_lr=1e-3, max_lr=1e-3, min_lr=1e-3, lr_warmup_steps=0,
                                        lr_decay_steps=100, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=100, wd_incr_style="constant")
    _update_model_config_funcs([model], config, ddp, optimizer, align_grad_reduce=True,
                               pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    return model, optimizer, scheduler, ddp


def model_config(cp: int, moe: bool):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    experts = dict(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.05,
                   moe_router_load_balancing_type="aux_loss", add_bias_linear=False) if moe else {}
    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, context_parallel_size=cp,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        calculate_per_token_loss=True, variable_seq_lengths=True, moe_token_dispatcher_type="alltoall", **experts)


def policy_cfg(split: str, cp: int) -> dict:
    """The keys of NeMo-RL's PolicyConfig its Megatron training path reads."""
    return {"train_global_batch_size": GBS, "train_micro_batch_size": 2, "max_total_sequence_length": 32,
            "make_sequence_length_divisible_by": 2 * cp if cp > 1 else 1, "logprob_chunk_size": None,
            "dynamic_batching": {"enabled": split == "dynamic", "train_mb_tokens": MB_TOKENS,
                                 "sequence_length_round": 4},
            "sequence_packing": {"enabled": split == "packing", "train_mb_tokens": MB_TOKENS,
                                 "algorithm": "modified_first_fit_decreasing", "fuse_loss": False},
            "megatron_cfg": {"enabled": True, "tensor_model_parallel_size": 1, "sequence_parallel": False,
                             "pipeline_model_parallel_size": 1, "context_parallel_size": cp,
                             "empty_unused_memory_level": 0, "moe_per_layer_logging": False,
                             "use_fused_linear_logprobs": False,
                             "distributed_data_parallel_config": {"overlap_grad_reduce": False}}}


def make_worker(model, optimizer, scheduler, ddp, cfg: dict):
    """NeMo-RL's worker class under Ray's decorator, with only the attributes ``train`` and the split
    path read (``/work/scratch``'s probe recorded them)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.utils import StragglerDetector
    from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorkerImpl
    from nemo_rl.utils.timer import Timer

    worker = object.__new__(MegatronPolicyWorkerImpl)
    worker.__dict__.update(
        cfg=cfg, model=model, optimizer=optimizer, scheduler=scheduler,
        mcore_state=types.SimpleNamespace(straggler_timer=StragglerDetector()),
        megatron_cfg=types.SimpleNamespace(optimizer=types.SimpleNamespace(reuse_grad_buf_for_mxfp8_param_ag=False),
                                           ddp=ddp),
        sampling_params=None, draft_model=None, dp_size=parallel_state.get_data_parallel_world_size(),
        rank=dist.get_rank(), timer=Timer(context={"worker": "megatron_policy"}), dtype=torch.float32,
        defer_fp32_logits=False, delegate_pack_to_model=False, delegate_mtp_loss_mask_to_model=False,
        model_slices_context_parallel_inputs=False, media_placeholder_token_id=None, _router_replay_enabled=False,
        _first_train_step_forward_pre_hook_disabled=False)
    return worker


class LocalPolicy:
    """The driver's ``Policy.train`` for this process: NeMo-RL's ``shard_by_batch_size`` with the
    arguments ``Policy._shard_for_train`` passes, then this rank's worker (no Ray)."""

    def __init__(self, worker, cfg: dict):
        self.worker, self.cfg = worker, cfg

    def shard(self, data, gbs: int):
        from megatron.core import parallel_state

        dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        cfg = self.cfg
        if cfg["dynamic_batching"]["enabled"]:
            args = {"input_key": "input_ids", "input_lengths_key": "input_lengths",
                    "sequence_length_round": cfg["dynamic_batching"]["sequence_length_round"],
                    "max_tokens_per_microbatch": cfg["dynamic_batching"]["train_mb_tokens"]}
            return data.shard_by_batch_size(dp, batch_size=gbs, dynamic_batching_args=args)[0][rank]
        if cfg["sequence_packing"]["enabled"]:
            args = {"algorithm": cfg["sequence_packing"]["algorithm"], "input_key": "input_ids",
                    "input_lengths_key": "input_lengths",
                    "sequence_length_pad_multiple": cfg["make_sequence_length_divisible_by"],
                    "max_tokens_per_microbatch": cfg["sequence_packing"]["train_mb_tokens"]}
            return data.shard_by_batch_size(dp, batch_size=gbs, sequence_packing_args=args)[0][rank]
        return data.shard_by_batch_size(dp, batch_size=gbs)[rank]

    def train(self, data, loss_fn, eval_mode=False, gbs=None, mbs=None, timer=None, check_dim_skip_keys=None):
        gbs = gbs or self.cfg["train_global_batch_size"]
        return self.worker.train(self.shard(data, gbs), loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs)


# ---------------------------------------------------------------- the batch
def make_batch(model, moe: bool):
    """GRPO's training fields for 4 prompts x 4 responses (ragged lengths, holes in the token mask,
    one sample_mask 0), log-probs near the model's own at its initial weights (so PPO's clip and
    the truncation are partly active), GRPO advantages plus 1.5 (0 for the MoE aux-only steps)."""
    import torch
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=g) for n in torch.randint(3, 7, (GROUPS,), generator=g)]
    rows = [(i // GROUP_SIZE, int(n)) for i, n in enumerate(torch.randint(2, 14, (GROUPS * GROUP_SIZE,), generator=g))]
    width = max(len(prompts[p]) + n for p, n in rows)
    width += (-width) % 4  # packed with CP 2, each sequence is padded to a multiple of 2 * cp
    count = len(rows)
    input_ids = torch.zeros(count, width, dtype=torch.long)
    token_mask = torch.zeros(count, width)
    lengths = torch.zeros(count, dtype=torch.long)
    generated = torch.zeros(count, width)
    for i, (p, n) in enumerate(rows):
        ids = torch.cat([prompts[p], torch.randint(3, VOCAB, (n,), generator=g)])
        input_ids[i, :len(ids)] = ids
        lengths[i] = len(ids)
        generated[i, len(prompts[p]):len(ids)] = 1.0
        token_mask[i, len(prompts[p]):len(ids)] = (torch.rand(n, generator=g) > 0.15).float()
        token_mask[i, len(prompts[p])] = 1.0
    sample_mask = torch.ones(count)
    sample_mask[5] = 0.0
    rewards = torch.randint(0, 2, (count,), generator=g).float()
    grouped = rewards.view(GROUPS, GROUP_SIZE)
    # GRPO's advantages, shifted by 1.5: centred advantages make J a cancellation of O(1) terms (about 0
    # at ratio 1), whose float32 rounding would sit at the 1e-6 check; shifted, J is of order 1
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1) + 1.5
    advantages = torch.zeros(count) if moe else advantages
    own = own_logprobs(model, input_ids, lengths)
    noise = lambda scale: (torch.rand(count, width, generator=g) * 2 - 1) * scale  # noqa: E731
    prev = own + noise(0.05)
    data = {"input_ids": input_ids, "input_lengths": lengths, "token_mask": token_mask, "sample_mask": sample_mask,
            "advantages": advantages.unsqueeze(1).expand(count, width).contiguous(),
            # NeMo-RL's generation log-probs: 0 on every token it did not generate
            "prev_logprobs": prev, "generation_logprobs": (prev + noise(0.05)) * generated,
            "reference_policy_logprobs": prev + noise(0.3)}
    return BatchedDataDict(data), [p for p, _ in rows]


def own_logprobs(model, input_ids, lengths):
    """The model's log-probs of every next token at its current weights, one unpacked row at a time,
    aligned like NeMo-RL's ``prev_logprobs`` (position t scores token t; position 0 is 0)."""
    import torch

    out = torch.zeros(input_ids.shape, dtype=torch.float32)
    module = model.module
    with torch.no_grad():
        for i in range(input_ids.shape[0]):
            n = int(lengths[i])
            ids = input_ids[i:i + 1, :n]
            logits = module(ids, torch.arange(n)[None], None)
            lp = torch.log_softmax(logits[0].float(), -1)
            out[i, 1:n] = lp[:-1].gather(1, ids[0, 1:, None])[:, 0]
    return out


# ---------------------------------------------------------------- one case
def run_case(case, cp: int, batch, groups: list) -> dict:
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossConfig, ClippedPGLossFn

    from megatron_pg_agg.integrations.nemo_rl.plugin import step_batch, use_pg_agg

    name, mode, split, path, kind, keys = case
    moe = name.startswith("moe")
    # every case is a fresh run: megatron-core keeps the aux-loss scale as a class attribute, shaped by
    # the first set_loss_scale (NeMo-RL's train() hands a 0-d scale, its split path a [1]-shaped one)
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    model, optimizer, scheduler, ddp = build(cp, split, moe)
    cfg = policy_cfg(split, cp)
    policy = LocalPolicy(make_worker(model, optimizer, scheduler, ddp, cfg), cfg)
    steps = []
    original_step = optimizer.step

    def capture_then_step():
        steps.append({"grad": {n: p.main_grad.detach().clone() for n, p in model.module.named_parameters()},
                      "weights": {n: p.detach().clone() for n, p in model.module.named_parameters()}})
        return original_step()

    optimizer.step = capture_then_step
    loss = ClippedPGLossFn(ClippedPGLossConfig(**keys))
    if kind == "plugin":
        block = {"mode": mode, **({"divisor": MODES[mode]} if MODES[mode] else {})}
        grpo = types.SimpleNamespace(seq_logprob_error_threshold=None, num_generations_per_prompt=GROUP_SIZE)
        config = types.SimpleNamespace(loss_fn=types.SimpleNamespace(pg_agg=block), policy=cfg, grpo=grpo,
                                       data_plane=None)
        loss = use_pg_agg(config, policy, loss)
    t1 = time.monotonic()
    if path == "train":
        objectives = [float(v) * STEPS for v in policy.train(batch, loss)["global_loss"]]
    else:  # the split path: one begin / train_microbatch / finish per optimizer step
        data = step_batch(batch, loss, GBS) if kind == "plugin" else batch
        shard = policy.shard(data, GBS)
        local = GBS // parallel_state.get_data_parallel_world_size()
        objectives = []
        for b in range(STEPS):
            policy.worker.begin_train_step(loss)
            policy.worker.train_microbatch(shard.get_batch(batch_idx=b, batch_size=local))
            objectives.append(float(policy.worker.finish_train_step()["global_loss"].sum()))
    elapsed = time.monotonic() - t1
    assert len(steps) == STEPS, (name, len(steps))
    return {"name": name, "mode": mode, "split": split, "path": path, "kind": kind, "keys": keys, "cp": cp,
            "objectives": objectives, "steps": steps, "seconds": elapsed, "moe": moe}


def layouts(world: int) -> list:
    return [(1, 1)] if world == 1 else [(2, 1), (1, 2)]


def main(argv: list) -> None:
    out_dir = argv[0]
    wanted = set(argv[1].split(",")) if len(argv) > 1 else None
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("NRL_LOG_LEVEL", "ERROR")
    import logging

    logging.getLogger("megatron").setLevel(logging.WARNING)
    import torch.distributed as dist

    dist.init_process_group("gloo")
    from megatron_pg_agg.integrations.nemo_rl.cpu import apply_nemo_rl_cpu_patches

    apply_nemo_rl_cpu_patches()
    from megatron.core import parallel_state

    world, rank = dist.get_world_size(), dist.get_rank()
    summary = {"world": world, "cases": [], "times": {"ready": time.monotonic() - T0}}
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    # the batches of every layout, at the initial weights (every case builds the same ones), made
    # while CP is 1 (their rows are forwarded unpacked, whole)
    batches = {moe: make_batch(build(1, "fixed", moe)[0], moe) for moe in (False, True)}
    for dp, cp in layouts(world):
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=cp)
        layout = f"dp{dp}_cp{cp}"
        for case in cases(cp):
            if wanted is not None and case[0] not in wanted:
                continue
            batch, groups = batches[case[0].startswith("moe")]
            result = run_case(case, cp, batch, groups)
            if rank == 0:
                data = {k: v for k, v in batch.items()}
                torch.save({**result, "layout": layout, "batch": data, "groups": groups},
                           os.path.join(out_dir, f"{layout}__{case[0]}.pt"))
                summary["cases"].append({"layout": layout, "name": case[0], "seconds": result["seconds"],
                                         "objectives": result["objectives"]})
                print(f"nemo_rl_checks {layout} {case[0]}: {result['seconds']:.2f}s J {result['objectives']}",
                      flush=True)
    summary["times"]["total"] = time.monotonic() - T0
    if rank == 0:
        with open(os.path.join(out_dir, f"summary_world{world}.json"), "w") as f:
            json.dump(summary, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])

"""AReaL 1.0.4's own Megatron PPO actor on CPU (gloo): one ``compute_advantages`` + ``ppo_update``.

    python -m tests.distributed.workers.areal_worker --make-model DIR
    torchrun --standalone --nproc-per-node {1,2} -m tests.distributed.workers.areal_worker DIR OUT.json [PARAMS]

``--make-model`` writes a tiny Qwen3 (2 layers, hidden 64, vocab 128, random weights from seed 3:
``megatron_pg_agg.integrations.bridge.tiny_hf``) and a local word-level tokenizer (AReaL's engine loads one
with ``AutoTokenizer``; nothing comes from a hub) to DIR.

The run builds AReaL's ``MegatronPPOActor`` as AReaL's trainer does in SPMD mode
(``rl_trainer._create_train_engine``): ``PPOActorConfig`` (``backend="megatron:d<world>"``, parsed by
AReaL's ``ModelAllocation``), ``create_process_group(alloc.parallel)``, ``initialize(None,
FinetuneSpec)`` (mbridge builds the model from DIR and loads its weights; DDP and megatron-core's
distributed optimizer by default), all in float32, after ``apply_areal_cpu_patches()``
(``megatron_pg_agg/integrations/areal/cpu/__init__.py``). The batch is 4 prompt groups x 3 responses of ragged
lengths, as AReaL's ``GroupedRolloutWorkflow`` hands it over: one dict per group (``input_ids``,
``attention_mask``, ``loss_mask``, ``logprobs``, ``versions``, ``rewards``; each response padded
to its group's longest, AReaL's own ``concat_padded_tensors``). The log-probs are the model's own
(transformers, float32) plus noise, so the PPO clip is partly active. DP rank r gets the groups
``[r*4/world, (r+1)*4/world)``. GRPO settings: group advantage normalisation (group size 3),
``kl_ctl=0``, ``eps_clip=0.2``.

The engine's ``optimizer_step`` is replaced by a capture of the step's full gradient (what
megatron-core's schedule, DDP and ``finalize_model_grads`` left in the DDP grad buffers; under the
distributed optimizer each rank's reduce-scattered shard of every bucket is all-gathered over DP),
then, with ``"optimizer_step": true``, AReaL's own step runs on it (its stats are kept).

PARAMS: JSON (inline or a file path), keys and defaults: ``n_mbs`` 1, ``max_tokens_per_mb`` null,
``ppo_n_minibatches`` 1, ``distributed_optimizer`` true (false: plain DDP; AReaL's checkpointer,
which asserts the distributed optimizer, is then skipped), ``optimizer_step`` false, ``seed`` 1.

Before the update, AReaL's own ``compute_logp`` (the engine's forward) is compared with
transformers' log-probs of the same folder: ``logp_error`` (max abs over every response token, all
ranks) shows that the model mbridge built and loaded on CPU is the HF model.

OUT (rank 0, JSON): ``world``, ``params``, ``names`` and ``numels`` (parameter order of the flat
gradient: megatron-core's parameter names, sorted), ``steps`` (one per optimizer step, in order:
``grad`` the flat float32 gradient as a list, ``grad_norm``; ``reported_grad_norm`` AReaL's when it
stepped), ``logp_error``, ``stats`` (AReaL's ``export_stats()`` after the update, reduced over DP:
``ppo_actor/update/num_micro_batches``, ``.../actor_loss/avg``, ...), ``times`` (seconds:
``import``, ``initialize``, ``logp``, ``update``, ``total``).
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

T0 = time.monotonic()
GROUPS = 4
GROUP_SIZE = 3
PROMPT_LENGTHS = (5, 3, 7, 4)
RESPONSE_LENGTHS = ((6, 2, 9), (4, 11, 3), (7, 1, 5), (8, 3, 10))
REWARDS = ((1.0, 0.0, 0.0), (0.0, 1.0, 1.0), (1.0, 1.0, 0.0), (0.5, 0.0, 1.0))
VOCAB = 128
DEFAULTS = dict(n_mbs=1, max_tokens_per_mb=None, ppo_n_minibatches=1, distributed_optimizer=True,
                optimizer_step=False, seed=1)


def make_model(path: str) -> str:
    """The tiny Qwen3 and a word-level tokenizer of its vocabulary (``t0`` ... ``t127``)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    from megatron_pg_agg.integrations.bridge.tiny_hf import make_tiny_model

    make_tiny_model("qwen3", path, seed=3, vocab_size=VOCAB, num_layers=2)
    core = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    core.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0", pad_token="t0", eos_token="t1").save_pretrained(path)
    return path


def make_groups(path: str) -> tuple[list[dict], list[list]]:
    """The whole batch (every rank the same): one dict per prompt group, as AReaL's workflow makes
    it, and per group the rows' ``(prompt length, transformers' own response log-probs)``."""
    from areal.utils.data import concat_padded_tensors
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    groups, reference = [], []
    for prompt_len, lengths, rewards in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, REWARDS):
        prompt = torch.randint(2, VOCAB, (prompt_len,), generator=g)
        rows = []
        reference.append([])
        for length, reward in zip(lengths, rewards):
            seq = torch.cat([prompt, torch.randint(2, VOCAB, (length,), generator=g)])
            with torch.no_grad():
                logp = torch.log_softmax(model(seq[None]).logits[0].float(), -1)
            # logprobs[i] = log p(seq[i] | seq[:i]) on response tokens (the inference engine's), plus noise
            own = logp[torch.arange(prompt_len - 1, len(seq) - 1), seq[prompt_len:]]
            noisy = own + 0.3 * torch.randn(length, generator=g)
            reference[-1].append((prompt_len, own))
            rows.append({k: v.unsqueeze(0) for k, v in {
                "input_ids": seq.to(torch.int32),
                "loss_mask": torch.tensor([0] * prompt_len + [1] * length, dtype=torch.int32),
                "logprobs": torch.cat([torch.zeros(prompt_len), noisy]).float(),
                "versions": torch.tensor([-1] * prompt_len + [0] * length, dtype=torch.int32),
                "attention_mask": torch.ones(len(seq), dtype=torch.bool),
                "rewards": torch.tensor(reward, dtype=torch.float32),
            }.items()})
        groups.append(concat_padded_tensors(rows))
    return groups, reference


def logp_error(actor, mine: list[dict], reference: list[list]) -> float:
    """Max |AReaL engine's log-prob - transformers'| over the rank's response tokens (AReaL's own
    ``compute_logp``: position i holds log p(token i+1)): the model mbridge built and loaded on CPU
    (local layers, THD attention, the renamed norms) is the HF model."""
    worst = 0.0
    for logp, rows in zip(actor.compute_logp(mine), reference):
        for i, (prompt_len, own) in enumerate(rows):
            mine_logp = logp[i, prompt_len - 1:prompt_len - 1 + len(own)].float()
            worst = max(worst, float((mine_logp - own).abs().max()))
    return worst


def actor_config(path: str, world: int, p: dict):
    from areal.api.cli_args import (
        DistributedDataParallelConfig,
        MegatronEngineConfig,
        MicroBatchSpec,
        NormConfig,
        OptimizerConfig,
        PPOActorConfig,
    )

    return PPOActorConfig(
        experiment_name="pg_agg", trial_name="cpu", path=path, backend=f"megatron:d{world}", dtype="float32",
        grad_reduce_dtype="float32", disable_dropout=True,
        mb_spec=MicroBatchSpec(n_mbs=p["n_mbs"], max_tokens_per_mb=p["max_tokens_per_mb"]),
        optimizer=OptimizerConfig(type="adam", lr=1e-3, weight_decay=0.0, gradient_clipping=1.0,
                                  warmup_steps_proportion=0.0),
        megatron=MegatronEngineConfig(ddp=DistributedDataParallelConfig(
            use_distributed_optimizer=p["distributed_optimizer"])),
        ppo_n_minibatches=p["ppo_n_minibatches"], eps_clip=0.2, kl_ctl=0.0,
        adv_norm=NormConfig(mean_level="group", std_level="group", group_size=GROUP_SIZE),
    )


def critic_config(path: str, world: int, eps_clip: float = 0.05):
    """AReaL's ``PPOCriticConfig`` for the same folder, as its examples configure a Megatron critic
    (``is_critic``: AReaL's value head in place of the LM head, random without ``value_head.pt``):
    the actor's backend, dtype and optimizer, AReaL's distributed optimizer."""
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, PPOCriticConfig

    return PPOCriticConfig(
        experiment_name="pg_agg", trial_name="cpu", path=path, backend=f"megatron:d{world}", dtype="float32",
        grad_reduce_dtype="float32", disable_dropout=True, is_critic=True, mb_spec=MicroBatchSpec(n_mbs=1),
        optimizer=OptimizerConfig(type="adam", lr=1e-3, weight_decay=0.0, gradient_clipping=1.0,
                                  warmup_steps_proportion=0.0),
        ppo_n_minibatches=1, eps_clip=eps_clip,
    )


def full_gradient(actor) -> tuple[list, list, torch.Tensor]:
    """``(names, numels, flat)``: every parameter's reduced gradient from the DDP grad buffers, in
    sorted name order; a distributed optimizer's reduce-scattered bucket shards are all-gathered."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    group = mpu.get_data_parallel_group(with_context_parallel=True)
    dp, rank = dist.get_world_size(group), dist.get_rank(group)
    grads = {}
    for chunk in actor.model:
        names = {param: name for name, param in chunk.module.named_parameters()}
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            for bucket in buffer.buckets:
                data = bucket.grad_data.clone()
                if buffer.ddp_config.use_distributed_optimizer and dp > 1:
                    out = torch.empty_like(data)
                    dist.all_gather(list(shard_buffer(out, dp)), shard_buffer(data, dp)[rank].contiguous(),
                                    group=group)
                    data = out
                for param, (start, end) in bucket.param_to_index.items():
                    grads[names[param]] = data[start:end].view(param.shape)
    names = sorted(grads)
    return names, [grads[n].numel() for n in names], torch.cat([grads[n].reshape(-1).float() for n in names])


def main(argv: list[str]) -> None:
    if argv[:1] == ["--make-model"]:
        print(make_model(argv[1]))
        return
    path, out_path = argv[0], argv[1]
    params = dict(DEFAULTS)
    if len(argv) > 2:
        params.update(json.loads(open(argv[2]).read() if os.path.isfile(argv[2]) else argv[2]))
    torch.set_num_threads(1)

    from megatron_pg_agg.integrations.areal.cpu import apply_areal_cpu_patches

    apply_areal_cpu_patches()
    import torch.distributed as dist
    from areal.api.alloc_mode import ModelAllocation
    from areal.api.io_struct import FinetuneSpec
    from areal.engine import MegatronPPOActor
    from areal.utils.seeding import set_random_seed

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if not params["distributed_optimizer"]:
        import areal.engine.megatron_engine as engine_module

        # measurement only: AReaL's checkpointer asserts the distributed optimizer; plain DDP runs without it
        engine_module.MegatronCheckpointManager = lambda *a, **k: None
    t_import = time.monotonic() - T0
    set_random_seed(params["seed"], key=f"actor{rank}")
    config = actor_config(path, world, params)
    alloc = ModelAllocation.from_str(config.backend, name="actor")
    actor = MegatronPPOActor(config=config)
    actor.create_process_group(parallel_strategy=alloc.parallel)
    actor.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=GROUPS * GROUP_SIZE,
                                        train_batch_size=GROUPS * GROUP_SIZE))
    t_init = time.monotonic() - T0 - t_import
    assert all(p.dtype == torch.float32 for c in actor.model for p in c.parameters()), "not float32"

    steps = []
    step = actor.optimizer_step

    def capture_then_step():
        names, numels, flat = full_gradient(actor)
        steps.append(dict(grad=flat, names=names, numels=numels, grad_norm=float(flat.norm())))
        if params["optimizer_step"]:
            stats = step()
            steps[-1]["reported_grad_norm"] = stats["grad_norm"]
            return stats
        return dict(update_successful=1.0, grad_norm=steps[-1]["grad_norm"],
                    lr=actor.optimizer.param_groups[0]["lr"])

    actor.optimizer_step = capture_then_step
    groups, reference = make_groups(path)
    pick = slice(rank * GROUPS // world, (rank + 1) * GROUPS // world)
    mine = groups[pick]
    t1 = time.monotonic()
    error = torch.tensor(logp_error(actor, mine, reference[pick]))
    dist.all_reduce(error, op=dist.ReduceOp.MAX)
    t_logp = time.monotonic() - t1
    t1 = time.monotonic()
    data = actor.compute_advantages(mine)
    actor.ppo_update(data)
    t_update = time.monotonic() - t1
    stats = actor.export_stats()
    if rank == 0:
        result = dict(world=world, params=params, names=steps[0]["names"], numels=steps[0]["numels"],
                      steps=[dict(grad=s["grad"].tolist(), grad_norm=s["grad_norm"],
                                  **({"reported_grad_norm": s["reported_grad_norm"]} if "reported_grad_norm" in s
                                     else {})) for s in steps],
                      logp_error=float(error), stats=stats,
                      times=dict(import_=t_import, initialize=t_init, logp=t_logp, update=t_update,
                                              total=time.monotonic() - T0))
        result["times"]["import"] = result["times"].pop("import_")
        with open(out_path, "w") as f:
            json.dump(result, f)
        print(f"areal_worker: world {world} {params} steps {len(steps)} grad_norm "
              f"{[round(s['grad_norm'], 6) for s in steps]} logp_error {float(error):.2e} "
              f"times {json.dumps({k: round(v, 1) for k, v in result['times'].items()})}", flush=True)
    dist.barrier()
    actor.destroy()


if __name__ == "__main__":
    main(sys.argv[1:])

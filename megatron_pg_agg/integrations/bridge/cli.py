"""``launch/train_bridge_actor.py``: Megatron-Bridge's own training loop on rollout files.

    torchrun --nproc_per_node 2 launch/train_bridge_actor.py --hf-model DIR --rollouts FILE \\
        --pg-loss-aggregation prompt_mean --num-microbatches 2 --train-iters 10

The recipe (:func:`hf_recipe`) is a ``ConfigContainer`` built from the HF folder through
Megatron-Bridge (``AutoBridge.to_megatron_provider``, weights loaded by Bridge's own pre-wrap hook)
with Adam at a constant learning rate, as the trainer's; :func:`~.loop.use_pg_loss` adds the
``--pg-*`` objective; Bridge's ``pretrain`` runs it. Exit statuses as the trainer's: 0 done, 2
refused at start-up (every problem listed).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

from megatron_pg_agg.integrations.bridge.hf_folder import HFFolderError
from megatron_pg_agg.integrations.bridge.loop import use_pg_loss
from megatron_pg_agg.training.args import add_pg_agg_args, config_from_args
from megatron_pg_agg.training.logs import setup_logging
from megatron_pg_agg.training.run_config import StartupError
from megatron_pg_agg.training.worker_process import quiet_startup_noise, release_process_group

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="train_bridge_actor",
                                     description="Megatron-Bridge's training loop with the --pg-* objective.")
    parser.add_argument("--hf-model", required=True, metavar="PATH", help="a local HF causal-LM folder")
    parser.add_argument("--rollouts", default=None, help="rollout JSONL (default: the built-in synthetic set)")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--num-microbatches", type=int, default=2, help="per DP rank and step")
    parser.add_argument("--train-iters", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--clip-grad", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--metrics-file", default=None, help="one JSON record per iteration (rank 0)")
    parser.add_argument("--log-interval", type=int, default=1)
    add_pg_agg_args(parser)
    return parser


def hf_recipe(args):
    """The ``ConfigContainer`` of a run: the HF model through Bridge (TP/PP from the flags, fp32,
    the loss contract, the device's settings), Adam at a constant ``--lr``, no checkpoints, no
    validation."""
    from megatron_pg_agg.integrations.bridge.hf_model import check_weight_names, open_hf_model  # noqa: PLC0415
    from megatron_pg_agg.integrations.bridge.loop import bridge_classes  # noqa: PLC0415

    try:  # the folder, the install, then Bridge (open_hf_model applies the CPU import patch first)
        hf = open_hf_model(args.hf_model)
    except HFFolderError as err:
        raise StartupError(str(err)) from err
    bridge_classes()  # the loop's CPU patches, before Bridge's training modules are imported
    from megatron.bridge.training.config import (  # noqa: PLC0415
        CheckpointConfig,
        ConfigContainer,
        DistributedInitConfig,
        LoggerConfig,
        RNGConfig,
        SchedulerConfig,
        TrainingConfig,
        ValidationConfig,
    )
    from megatron.bridge.training.tokenizers.config import TokenizerConfig  # noqa: PLC0415
    from megatron.core.optimizer import OptimizerConfig  # noqa: PLC0415

    from megatron_pg_agg.megatron.model import default_ddp_config, hf_contract_settings  # noqa: PLC0415

    provider = hf.bridge.to_megatron_provider(load_weights=True)
    pp = args.pipeline_model_parallel_size
    for name, value in {**hf_contract_settings(), "tensor_model_parallel_size": args.tensor_model_parallel_size,
                        "pipeline_model_parallel_size": pp, "variable_seq_lengths": pp > 1,
                        "should_pad_vocab": False}.items():
        setattr(provider, name, value)
    provider.register_pre_wrap_hook(lambda chunks: (check_weight_names(hf, chunks), chunks)[1], prepend=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = world // (args.tensor_model_parallel_size * pp)
    return ConfigContainer(
        train=TrainingConfig(train_iters=args.train_iters, micro_batch_size=1,
                             global_batch_size=args.num_microbatches * max(dp, 1)),
        model=provider,
        optimizer=OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.lr, weight_decay=args.weight_decay,
                                  clip_grad=args.clip_grad, bf16=False, fp16=False, params_dtype=torch.float32,
                                  use_distributed_optimizer=False),
        ddp=default_ddp_config(grad_reduce_in_fp32=True),
        scheduler=SchedulerConfig(lr_decay_style="constant", start_weight_decay=args.weight_decay,
                                  end_weight_decay=args.weight_decay),
        dataset=None,
        logger=LoggerConfig(log_interval=args.log_interval),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=provider.vocab_size),
        checkpoint=CheckpointConfig(),
        validation=ValidationConfig(eval_iters=0),
        rng=RNGConfig(seed=args.seed),
        dist=DistributedInitConfig(distributed_backend="nccl" if torch.cuda.is_available() else "gloo"),
    )


def main(argv=None) -> int:
    setup_logging("[bridge]")
    quiet_startup_noise()
    args = build_parser().parse_args(argv)
    try:
        cfg = hf_recipe(args)
        forward_step, callbacks = use_pg_loss(cfg, config_from_args(args), rollouts=args.rollouts, seed=args.seed,
                                              metrics_file=args.metrics_file)
        from megatron.bridge.training.pretrain import pretrain  # noqa: PLC0415

        try:
            pretrain(cfg, forward_step, callbacks=callbacks)
        except HFFolderError as err:  # missing or extra tensors, found once the model's names are known
            raise StartupError(str(err)) from err
    except StartupError as err:
        logger.error(str(err))  # the same on every rank: rank 0 prints it, every rank exits 2
        release_process_group()
        return 2
    release_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""AReaL 1.0.4's GSM8K GRPO example (its examples/math/gsm8k_rl.py) training megatron_pg_agg's
exact objective: the same script with one line added, ``use_pg_agg(config)``.

    MEGATRON_PG_AGG_AREAL=prompt_mean python3 -m areal.infra.launcher.local launch/areal_gsm8k_grpo.py \\
        --config AREAL/examples/math/gsm8k_grpo_megatron.yaml

The objective comes from ``MEGATRON_PG_AGG_AREAL`` (``token_mean``, ``seq_mean``, ``prompt_mean``,
``constant:<L>``, optionally ``;group_baseline=response_mean_std``): on the launch as above, or in
AReaL's config as ``actor.scheduling_spec[0].env_vars`` (what reaches AReaL's worker processes
under its Ray and Slurm launchers and in single-controller mode). Needs a GPU node with AReaL's
own stack (SGLang for the rollouts); docs/areal.md.
"""
import sys

from areal import PPOTrainer
from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.dataset import get_custom_dataset
from areal.utils.hf_utils import load_hf_tokenizer

from megatron_pg_agg.integrations.areal.plugin import use_pg_agg


def main(args):
    config, _ = load_expr_config(args, GRPOConfig)
    use_pg_agg(config)  # the plug-in: AReaL's Megatron actor trains the chosen objective exactly
    tokenizer = load_hf_tokenizer(config.tokenizer_path)
    train_dataset = get_custom_dataset(split="train", dataset_config=config.train_dataset, tokenizer=tokenizer)
    valid_dataset = get_custom_dataset(split="test", dataset_config=config.valid_dataset, tokenizer=tokenizer)
    workflow_kwargs = dict(reward_fn="areal.reward.gsm8k.gsm8k_reward_fn", gconfig=config.gconfig,
                           tokenizer=config.tokenizer_path, enable_thinking=False)
    eval_workflow_kwargs = {**workflow_kwargs, "gconfig": config.gconfig.new(temperature=0.6)}
    with PPOTrainer(config, train_dataset=train_dataset, valid_dataset=valid_dataset) as trainer:
        trainer.train(workflow="areal.workflow.rlvr.RLVRWorkflow", workflow_kwargs=workflow_kwargs,
                      eval_workflow="areal.workflow.rlvr.RLVRWorkflow", eval_workflow_kwargs=eval_workflow_kwargs)


if __name__ == "__main__":
    main(sys.argv[1:])

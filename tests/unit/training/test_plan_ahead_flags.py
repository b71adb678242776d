"""The plan-ahead switch: ``--pg-plan-ahead`` (default) / ``--no-pg-plan-ahead`` on the trainer
and the Megatron-LM pretrain() entry, read into ``DataConfig.plan_ahead``."""
import argparse

from megatron_pg_agg.training.megatron_lm import add_actor_args
from megatron_pg_agg.training.run_config import DataConfig, RunConfig, parse_flags


def test_the_trainer_plans_ahead_unless_switched_off():
    """Would catch a default of off, or a --no-pg-plan-ahead that does not reach the config."""
    assert RunConfig.from_args(parse_flags(["--rollouts", "synthetic"])).data.plan_ahead is True
    assert RunConfig.from_args(parse_flags(["--rollouts", "synthetic", "--pg-plan-ahead"])).data.plan_ahead is True
    assert RunConfig.from_args(parse_flags(["--rollouts", "synthetic", "--no-pg-plan-ahead"])).data.plan_ahead is False


def test_the_megatron_lm_entry_has_the_switch_and_reads_it():
    """add_actor_args (the pretrain() entry's extra_args_provider) adds the flag, default on;
    DataConfig.from_megatron_lm_args reads it, and an entry without it (the RL entry until it adds
    the flag) plans ahead. Would catch the flag missing from the entry or not read."""
    parser = add_actor_args(argparse.ArgumentParser())
    base = ["--pg-rollouts", "r.jsonl"]
    for argv, want in (([], True), (["--no-pg-plan-ahead"], False), (["--pg-plan-ahead"], True)):
        ns = parser.parse_args(base + argv)
        ns.seq_length = 256
        assert DataConfig.from_megatron_lm_args(ns).plan_ahead is want, argv
    assert DataConfig.from_megatron_lm_args(argparse.Namespace(pg_rollouts=None, seq_length=8)).plan_ahead is True

"""--pg-loss-aggregation flags: an extra_args_provider that adds, refuses clashes, validates at parse time."""
import argparse

import pytest

from megatron_pg_agg import add_pg_agg_args, config_from_args


def _megatron_like_parser():
    # a stand-in for Megatron-LM's parser: some existing flags with their own defaults
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--calculate-per-token-loss", action="store_true")
    return parser


def test_adds_flags_with_defaults_and_leaves_existing_flags_alone():
    parser = _megatron_like_parser()
    before = {a.dest: a.default for a in parser._actions}
    assert add_pg_agg_args(parser) is parser
    args = parser.parse_args([])
    for dest, default in before.items():
        assert getattr(args, dest, default) == default
    cfg = config_from_args(args)
    assert cfg.mode == "token_mean" and cfg.divisor is None
    got = (cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip, cfg.kl_coef, cfg.entropy_coef)
    assert got == (0.2, 0.2, None, 0.0, 0.0)


def test_every_mode_and_alias_parses_to_a_typed_config():
    parser = add_pg_agg_args(_megatron_like_parser())
    args = parser.parse_args(["--pg-loss-aggregation", "constant", "--pg-loss-aggregation-divisor", "4096",
                              "--pg-clip-eps", "0.2", "--pg-clip-eps-high", "0.28", "--pg-dual-clip", "3",
                              "--pg-kl-coef", "0.01", "--pg-kl-estimator", "k1", "--pg-entropy-coef", "0.001",
                              "--lr", "1e-6"])
    cfg = config_from_args(args)
    assert (cfg.mode, cfg.divisor, cfg.clip_eps_high, cfg.dual_clip, cfg.kl_estimator) == (
        "constant", 4096.0, 0.28, 3.0, "k1")
    assert args.lr == 1e-6
    for alias, mode in (("seq-mean-token-mean", "seq_mean"), ("dapo", "token_mean"), ("grpo", "seq_mean")):
        assert config_from_args(parser.parse_args(["--pg-loss-aggregation", alias])).mode == mode
    assert config_from_args(parser.parse_args(["--pg-loss-aggregation", "seq-mean-token-sum"])).divisor == 1.0


@pytest.mark.parametrize("argv,words", [
    (["--pg-loss-aggregation-divisor", "8"], ["--pg-loss-aggregation-divisor", "constant"]),
    (["--pg-loss-aggregation", "constant"], ["--pg-loss-aggregation-divisor"]),
    (["--pg-loss-aggregation", "dr_grpo"], ["divisor"]),
    (["--pg-loss-aggregation", "constant", "--pg-loss-aggregation-divisor", "0"], ["positive"]),
    (["--pg-loss-aggregation", "sequence_mean"], ["invalid choice"]),
    (["--pg-dual-clip", "0.5"], ["dual_clip"]),
    (["--pg-clip-eps", "1.5"], ["clip_eps_low"]),
])
def test_bad_combinations_fail_at_parse_time(argv, words, capsys):
    parser = add_pg_agg_args(_megatron_like_parser())
    with pytest.raises(SystemExit) as info:
        parser.parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, (word, err)
    with pytest.raises(SystemExit):  # parse_known_args (Megatron-LM's ignore_unknown_args path) too
        parser.parse_known_args(argv + ["--some-unknown-flag"])


def test_a_clash_with_an_existing_flag_is_refused():
    parser = _megatron_like_parser()
    parser.add_argument("--pg-clip-eps", type=float, default=0.1)
    with pytest.raises(ValueError, match="--pg-clip-eps"):
        add_pg_agg_args(parser)
    assert parser.parse_args([]).pg_clip_eps == 0.1  # untouched


def test_adding_twice_is_a_clash_not_a_silent_duplicate():
    parser = add_pg_agg_args(_megatron_like_parser())
    with pytest.raises(ValueError, match="already defines"):
        add_pg_agg_args(parser)

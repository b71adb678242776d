"""The AReaL plug-in's settings, start-up refusals and group baseline, without AReaL's engine (the
baseline's control uses AReaL's own ``Normalization`` where AReaL is installed)."""
from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from megatron_pg_agg.integrations.areal.loss import ResponseGroupBaseline
from megatron_pg_agg.integrations.areal.plugin import (
    ENV,
    ArealConfigError,
    ArealSettings,
    config_problems,
    critic_config_problems,
    settings_from_env,
)
from megatron_pg_agg.integrations.objective import HostObjective
from tests.support.optional import REQUIRE_AREAL, require


def _one_and_three():
    """A group of two responses of 1 and 3 tokens with rewards 1 and 0 (GRPO's advantages before the
    baseline: the reward on every valid token), after a prompt of 2 tokens."""
    mask = torch.tensor([[0, 0, 1, 0, 0], [0, 0, 1, 1, 1]], dtype=torch.float32)
    return mask * torch.tensor([[1.0], [0.0]]), mask


def test_the_response_baseline_counts_each_response_once():
    """The issue's example: the baseline is 0.5 (GRPO's), not AReaL's token-weighted 0.25; with
    the std (unbiased, of [1, 0]: 0.7071) the two responses get +-0.7071. Catches a token-weighted
    mean or a biased std."""
    adv, mask = _one_and_three()
    mean_only = ResponseGroupBaseline(std=False)
    mean_only.group_sizes = [2]
    out = mean_only(adv, mask)
    assert out.tolist() == [[0, 0, 0.5, 0, 0], [0, 0, -0.5, -0.5, -0.5]]
    with_std = ResponseGroupBaseline(std=True, eps=0.0)
    with_std.group_sizes = [2]
    expected = 0.5 / (0.5 ** 0.5)
    assert torch.allclose(with_std(adv, mask),
                          torch.tensor([[0, 0, expected, 0, 0], [0, 0, -expected, -expected, -expected]]))


def test_ragged_groups_are_normalised_apart_and_an_empty_response_is_not_counted():
    """Groups of 3 and 2 rows (ragged, from AReaL's per-group records); the third response of the
    first group has no valid token: it is neither counted nor changed."""
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    rewards = torch.tensor([[2.0], [4.0], [9.0], [1.0], [3.0]])
    base = ResponseGroupBaseline(std=False)
    base.group_sizes = [3, 2]
    out = base(mask * rewards, mask)
    assert out.tolist() == [[-1, -1, 0], [1, 0, 0], [0, 0, 0], [-1, -1, -1], [1, 0, 0]]
    base.group_sizes = [2, 2]
    with pytest.raises(ValueError, match="needs the batch's groups"):
        base(mask * rewards, mask)


@pytest.mark.parametrize("std", [False, True])
def test_a_group_without_spread_gets_advantage_zero(std):
    """Groups of 3 responses all rewarded 0.9 (their float32 mean is 0.9 + 6e-8: AReaL's eps 1e-5
    would turn that into advantages of 6e-3), a singleton group, and a group of 2 with rewards 1
    and 0 beside them: the first two get exactly 0, the third the usual +-0.5 (no std) or +-0.7071
    (unbiased std, eps 1e-5). Catches a difference of rounding divided by eps, or a singleton's
    per-token deviation divided by eps (the outside check's 2.7e3)."""
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    rewards = torch.tensor([[0.9], [0.9], [0.9], [0.3], [1.0], [0.0]])
    base = ResponseGroupBaseline(std=std)
    base.group_sizes = [3, 1, 2]
    out = base(mask * rewards, mask)
    assert torch.equal(out[:4], torch.zeros(4, 3))
    spread = 0.5 / (0.5 ** 0.5 + 1e-5) if std else 0.5
    assert torch.allclose(out[4:], torch.tensor([[spread, 0, 0], [-spread, -spread, -spread]]), rtol=1e-6, atol=0)


def test_advantages_varying_along_a_response_are_refused_naming_areals_keys():
    """A singleton group whose tokens carry a KL term in the reward (deviations of 0.03, as in the
    outside check): refused, naming actor.kl_ctl, actor.discount and actor.gae_lambda, instead of
    (A_t - v) / eps. A deviation of float32 rounding (1e-7 relative) is accepted."""
    mask = torch.ones(2, 3)
    advantages = torch.tensor([[0.5, 0.53, 0.47], [0.2, 0.2, 0.2]])
    base = ResponseGroupBaseline(std=True)
    base.group_sizes = [1, 1]
    with pytest.raises(ValueError, match="row 0's advantages vary.*actor.kl_ctl=0, actor.discount=1 and "
                                         "actor.gae_lambda=1"):
        base(advantages, mask)
    rounding = torch.tensor([[0.5, 0.5 * (1 + 1e-7), 0.5], [0.2, 0.2, 0.2]])
    assert torch.equal(base(rounding, mask), torch.zeros(2, 3))


@pytest.mark.optional_stack
def test_control_areals_own_group_normalisation_is_token_weighted():
    require(None if importlib.util.find_spec("areal") else "AReaL is not installed (docs/areal.md)", REQUIRE_AREAL)
    from areal.api.cli_args import NormConfig
    from areal.utils.data import Normalization

    adv, mask = _one_and_three()
    theirs = Normalization(NormConfig(mean_level="group", std_level=None, group_size=2))(adv, mask)
    assert torch.allclose(theirs[0, 2], torch.tensor(0.75)) and torch.allclose(theirs[1, 2:], torch.tensor(-0.25))


def test_objective_round_trips_through_the_environment(monkeypatch):
    for settings in (ArealSettings(HostObjective("prompt_mean")), ArealSettings(HostObjective("constant", 512)),
                     ArealSettings(HostObjective("seq_mean"), group_baseline="response_mean_std")):
        monkeypatch.setenv(ENV, settings.encode())
        assert settings_from_env() == settings
    assert ArealSettings(HostObjective("constant", 512)).encode() == "constant:512"
    monkeypatch.setenv(ENV, "constant")
    with pytest.raises(ArealConfigError, match="needs divisor"):
        settings_from_env()
    monkeypatch.setenv(ENV, "token_mean;baseline=grpo")
    with pytest.raises(ArealConfigError, match="unknown option"):
        settings_from_env()
    monkeypatch.delenv(ENV)
    with pytest.raises(ArealConfigError, match="use_pg_agg"):
        settings_from_env()
    with pytest.raises(ValueError, match="group_baseline='token'"):
        ArealSettings(HostObjective("token_mean"), group_baseline="token")


def test_the_value_mode_round_trips_and_defaults_to_the_policys(monkeypatch):
    """``;value_mode=<mode>[:<L>]`` beside group_baseline, in either order, peers' names resolved;
    no value_mode: the critic's value term takes the policy's mode and divisor. Catches the option
    dropped on the way to the workers (encode/decode), or a default other than the policy's."""
    cases = {"seq_mean;value_mode=token_mean": ArealSettings(HostObjective("seq_mean"), value_mode="token_mean"),
             "constant:512;group_baseline=response_mean;value_mode=constant:64":
                 ArealSettings(HostObjective("constant", 512), "response_mean", "constant", 64),
             "prompt_mean;value_mode=seq-mean-token-sum":
                 ArealSettings(HostObjective("prompt_mean"), value_mode="constant", value_divisor=1),
             "token_mean;value_mode=seq_mean;group_baseline=response_mean_std":
                 ArealSettings(HostObjective("token_mean"), "response_mean_std", "seq_mean")}
    for text, settings in cases.items():
        monkeypatch.setenv(ENV, text)
        assert settings_from_env() == settings, text
        monkeypatch.setenv(ENV, settings.encode())
        assert settings_from_env() == settings
    assert ArealSettings(HostObjective("seq_mean"), value_mode="constant", value_divisor=64).encode() == \
        "seq_mean;value_mode=constant:64"
    assert ArealSettings(HostObjective("seq_mean")).encode() == "seq_mean"
    own = ArealSettings(HostObjective("constant", 512)).value_loss(0.5)
    assert (own.mode, own.divisor, own.clip_eps, own.factor) == ("constant", 512, 0.5, 0.5)
    other = ArealSettings(HostObjective("constant", 512), value_mode="seq_mean").value_loss(0.2)
    assert (other.mode, other.divisor, other.clip_eps) == ("seq_mean", None, 0.2)
    for text, message in (("token_mean;value_mode=constant", "needs divisor"),
                          ("token_mean;value_mode=bogus", "bogus"),
                          ("token_mean;value_mode=seq_mean;value_mode=seq_mean", "given twice"),
                          ("token_mean;value=seq_mean", "unknown option")):
        monkeypatch.setenv(ENV, text)
        with pytest.raises(ArealConfigError, match=message):
            settings_from_env()
    with pytest.raises(ValueError, match="value divisor goes with a value mode"):
        ArealSettings(HostObjective("token_mean"), value_divisor=4)


def _critic(**keys):
    return SimpleNamespace(**{"ppo_n_minibatches": 1, "is_critic": True, "eps_clip": 0.5, "backend": "megatron:d2",
                              "enable_tree_training": False, "mb_spec": SimpleNamespace(n_mbs=1),
                              "megatron": SimpleNamespace(bridge_type="mbridge"), **keys})


def test_critic_refusals_name_the_critic_keys():
    """AReaL's critic keys, each refused by name: a step shape that would cut a group or starve
    the micro-batches (critic.ppo_n_minibatches, critic.mb_spec.n_mbs), is_critic off, a clip
    range of 0, tree training, context or pipeline parallelism in critic.backend, and a bridge
    other than mbridge; AReaL's example critic (eps 0.5, 4 steps over 8 prompts a rank) is not.
    Catches a critic key checked under the actor's name, or a refusal missing."""
    settings = ArealSettings(HostObjective("prompt_mean"))
    assert critic_config_problems(_critic(ppo_n_minibatches=4), settings, prompts_per_step=16, dp_size=2,
                                  samples_per_prompt=4) == []
    (problem,) = critic_config_problems(_critic(ppo_n_minibatches=4), settings, prompts_per_step=6, dp_size=2)
    assert "critic.ppo_n_minibatches=4" in problem and "gives 3" in problem and "actor." not in problem, problem
    (problem,) = critic_config_problems(_critic(ppo_n_minibatches=2, mb_spec=SimpleNamespace(n_mbs=4)), settings,
                                        prompts_per_step=4, dp_size=2, samples_per_prompt=3)
    assert "critic.mb_spec.n_mbs=4" in problem and "critic.ppo_n_minibatches=2" in problem, problem
    for keys, expected in (({"is_critic": False}, "critic.is_critic=False"),
                           ({"eps_clip": 0.0}, "critic.eps_clip=0.0"),
                           ({"enable_tree_training": True}, "critic.enable_tree_training=True"),
                           ({"megatron": SimpleNamespace(bridge_type="megatron-bridge")},
                            "critic.megatron.bridge_type=megatron-bridge")):
        (problem,) = critic_config_problems(_critic(**keys), settings)
        assert expected in problem, (keys, problem)
    (problem,) = critic_config_problems(_critic(backend="megatron:d2c2"), settings, cp_size=2)
    assert "critic.backend=megatron:d2c2 has context parallelism" in problem, problem
    (problem,) = critic_config_problems(_critic(backend="megatron:d1p2"), settings, pp_size=2)
    assert "critic.backend=megatron:d1p2 has 2 pipeline stages" in problem, problem


def test_start_up_refusals_name_the_areal_keys():
    """A step shape that would cut a group, tree training, M2PO with a log-linear proximal
    approximation: each refused naming AReaL's keys; a shape that fits is not."""
    actor = SimpleNamespace(ppo_n_minibatches=4, enable_tree_training=False, m2_threshold=None)
    settings = ArealSettings(HostObjective("prompt_mean"))
    assert config_problems(actor, settings, prompts_per_step=8, dp_size=2) == []
    (problem,) = config_problems(actor, settings, prompts_per_step=6, dp_size=2)
    assert "actor.ppo_n_minibatches=4" in problem and "train_dataset.batch_size=6" in problem and "gives 3" in problem
    tree = SimpleNamespace(ppo_n_minibatches=1, enable_tree_training=True)
    assert "actor.enable_tree_training=True" in config_problems(tree, settings)[0]
    m2 = SimpleNamespace(ppo_n_minibatches=1, m2_threshold=0.04, prox_logp_method="loglinear", use_decoupled_loss=True)
    assert "actor.m2_threshold with actor.prox_logp_method=loglinear" in config_problems(m2, settings)[0]


def test_megatron_fsdp_wrappers_are_refused_naming_the_areal_keys():
    """actor.megatron.use_torch_fsdp2 / use_custom_fsdp (AReaL's switches to megatron-core's torch
    FSDP2 and Megatron-FSDP wrappers, passed to mbridge's get_model), and the critic's: each refused
    naming its key; AReaL's defaults (both off) are not."""
    settings = ArealSettings(HostObjective("token_mean"))
    for role, check in (("actor", config_problems), ("critic", critic_config_problems)):
        for key, expected in (("use_torch_fsdp2", "torch-FSDP2 wrapper"),
                              ("use_custom_fsdp", "#7452, finding 12")):
            megatron = SimpleNamespace(bridge_type="mbridge", use_torch_fsdp2=False, use_custom_fsdp=False)
            setattr(megatron, key, True)
            config = SimpleNamespace(ppo_n_minibatches=1, megatron=megatron)
            (problem,) = check(config, settings)
            assert problem.startswith(f"{role}.megatron.{key}=True: ") and expected in problem, problem
        defaults = SimpleNamespace(ppo_n_minibatches=1, megatron=SimpleNamespace(
            bridge_type="mbridge", use_torch_fsdp2=False, use_custom_fsdp=False))
        assert check(defaults, settings) == []


def test_a_group_baseline_with_advantages_varying_along_a_response_is_refused_at_start_up():
    """group_baseline under AReaL's default kl_ctl=0.1, a discount or a GAE lambda below 1: each
    refused naming the key and its value; kl_ctl=0, discount=gae_lambda=1 are accepted, and
    without group_baseline AReaL's defaults are not refused."""
    def actor(**keys):
        return SimpleNamespace(ppo_n_minibatches=1, **{"kl_ctl": 0.0, "discount": 1.0, "gae_lambda": 1.0, **keys})

    baseline = ArealSettings(HostObjective("seq_mean"), group_baseline="response_mean_std")
    assert config_problems(actor(), baseline) == []
    for key, value in (("kl_ctl", 0.1), ("discount", 0.99), ("gae_lambda", 0.95)):
        (problem,) = config_problems(actor(**{key: value}), baseline)
        assert f"actor.{key}={value}" in problem and "group_baseline=response_mean_std" in problem, problem
    assert config_problems(actor(kl_ctl=0.1), ArealSettings(HostObjective("seq_mean"))) == []


def test_a_step_too_small_for_the_micro_batch_count_is_refused_at_start_up():
    """The outside check's crash (DP 2, ppo_n_minibatches=2, mb_spec.n_mbs=4, groups of 3: a step
    of one group holds 3 sequences, AReaL's allocator wants 4): refused naming the keys; 4 prompts
    per rank (2 groups, 6 sequences a step) fit; with 2 pipeline stages AReaL asks for 4
    micro-batches even at n_mbs=1. Catches the check missing, or a bound other than the
    pigeonhole's floor(groups per rank / steps) groups."""
    def problems(prompts, n_mbs, pp_size=1, n_steps=2):
        actor = SimpleNamespace(ppo_n_minibatches=n_steps, mb_spec=SimpleNamespace(n_mbs=n_mbs))
        return config_problems(actor, ArealSettings(HostObjective("token_mean")), prompts_per_step=prompts,
                               dp_size=2, samples_per_prompt=3, pp_size=pp_size)

    (problem,) = problems(prompts=4, n_mbs=4)
    for key in ("actor.mb_spec.n_mbs=4", "needs 4 sequences", "at most 3", "train_dataset.batch_size=4",
                "gconfig.n_samples=3", "actor.ppo_n_minibatches=2"):
        assert key in problem, problem
    assert problems(prompts=8, n_mbs=4) == [] and problems(prompts=4, n_mbs=3) == []
    assert problems(prompts=6, n_mbs=4, n_steps=2) != []  # 3 groups a rank: some step holds one (3 sequences)
    assert "2 x 2 pipeline stages" in problems(prompts=4, n_mbs=1, pp_size=2)[0]


def test_a_relative_model_folder_is_made_absolute(tmp_path, monkeypatch):
    """actor.path / ref.path naming a folder relative to the working directory become absolute
    (mbridge would join the relative path onto itself); absolute paths, hub names and missing
    folders are left as given."""
    from megatron_pg_agg.integrations.areal.plugin import _absolute_model_paths

    (tmp_path / "model").mkdir()
    monkeypatch.chdir(tmp_path)
    config = SimpleNamespace(actor=SimpleNamespace(path="model"), ref=SimpleNamespace(path="Qwen/Qwen3-0.6B"))
    _absolute_model_paths(config)
    assert config.actor.path == str(tmp_path / "model") and config.ref.path == "Qwen/Qwen3-0.6B"
    _absolute_model_paths(config)
    assert config.actor.path == str(tmp_path / "model")


USE_PG_AGG = """
import importlib, os, subprocess, sys
from megatron_pg_agg.integrations.areal.cpu import apply_areal_cpu_patches
apply_areal_cpu_patches()  # CPU: AReaL's engine module imports megatron.bridge (stood in here)
import areal.engine
from areal.api.cli_args import GRPOConfig
from areal.engine.megatron_engine import MegatronPPOActor as own, MegatronPPOCritic as own_critic
from megatron_pg_agg.integrations.areal.plugin import ENV, ArealSettings, use_pg_agg
from megatron_pg_agg.integrations.objective import HostObjective
config = GRPOConfig()
config.train_dataset.batch_size, config.actor.ppo_n_minibatches = 8, 2
os.environ[ENV] = "constant:512;group_baseline=response_mean"
try:  # AReaL's default kl_ctl=0.1 puts a KL into the reward: refused with a group baseline
    use_pg_agg(config)
    raise SystemExit("kl_ctl=0.1 was not refused")
except ValueError as error:
    assert "actor.kl_ctl=0.1" in str(error), error
config.actor.kl_ctl = 0.0
assert use_pg_agg(config) == ArealSettings(HostObjective("constant", 512), "response_mean")
assert all(s.env_vars[ENV] == os.environ[ENV] for s in config.actor.scheduling_spec)
from areal.engine import MegatronPPOActor as chosen  # what AReaL's trainer imports
assert chosen is not own and issubclass(chosen, own)
assert areal.engine.MegatronPPOCritic is own_critic  # no critic configured: AReaL's own is left alone

# a Megatron critic (AReaL's PPOConfig): refusals by name, then the plug-in's critic installed
from areal.api.cli_args import PPOConfig, PPOCriticConfig
def with_critic(backend="megatron:d1"):
    c = PPOConfig()
    c.actor.backend, c.train_dataset.batch_size, c.actor.ppo_n_minibatches = "megatron:d1", 8, 2
    c.critic = PPOCriticConfig(backend=backend, is_critic=True, ppo_n_minibatches=2)
    return c
for backend, expected in (("fsdp:d1", "critic.backend=fsdp:d1"), ("megatron:d1c2", "has context parallelism")):
    try:
        use_pg_agg(with_critic(backend), "seq_mean")
        raise SystemExit(backend + " was not refused")
    except ValueError as error:
        assert expected in str(error), error
c = with_critic()
c.actor.kl_ctl = 0.0
try:
    use_pg_agg(c, "seq_mean", group_baseline="response_mean")
    raise SystemExit("group_baseline with a critic was not refused")
except ValueError as error:
    assert "with a critic" in str(error), error
c = with_critic()
assert use_pg_agg(c, "constant", 64, value_mode="seq_mean") == ArealSettings(HostObjective("constant", 64),
                                                                            value_mode="seq_mean")
assert all(s.env_vars[ENV] == "constant:64;value_mode=seq_mean" for s in c.critic.scheduling_spec)
from areal.engine import MegatronPPOCritic as critic  # what AReaL's trainer imports (_create_critic)
assert critic is not own_critic and issubclass(critic, own_critic)
paths = [k.__module__ + "." + k.__name__ for k in (chosen, critic)]  # what its single-controller workers import
code = ("from megatron_pg_agg.integrations.areal.cpu import apply_areal_cpu_patches; apply_areal_cpu_patches(); "
        "import importlib; areal = lambda c: next(b for b in c.__mro__ if b.__module__.startswith('areal.')); "
        "[print('CLASS', areal(c).__module__, areal(c).__name__) for c in "
        "(getattr(importlib.import_module(p.rpartition('.')[0]), p.rpartition('.')[2]) for p in %r)]" % paths)
out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
found = [line for line in out.stdout.splitlines() if line.startswith("CLASS ")]
print("WORKER", *paths, *found, out.returncode)
"""


@pytest.mark.optional_stack
def test_use_pg_agg_installs_the_actor_where_areals_trainer_and_workers_find_it():
    """In a fresh interpreter, on AReaL's own GRPOConfig: the objective from MEGATRON_PG_AGG_AREAL
    reaches every actor.scheduling_spec's env_vars, AReaL's trainer's lazy ``from areal.engine
    import MegatronPPOActor`` gets the plug-in's class, and that class's import path (what AReaL's
    single-controller workers import) resolves in another fresh interpreter. Catches the class
    not installed, an unimportable path, or the mode not written for the workers.

    Then on AReaL's PPOConfig with a Megatron critic (one interpreter, to keep the imports to one):
    an FSDP critic, a critic with context parallelism and group_baseline beside a critic are refused
    by name; the objective (with its value_mode) reaches critic.scheduling_spec's env_vars, and
    ``from areal.engine import MegatronPPOCritic`` (AReaL's ``_create_critic``) gets the plug-in's
    critic, whose path resolves in the worker interpreter too. Catches the critic not installed
    (today's stock critic silently beside the plug-in's actor) or its mode not written for its workers."""
    require(None if importlib.util.find_spec("areal") else "AReaL is not installed (docs/areal.md)", REQUIRE_AREAL)
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", USE_PG_AGG], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-5000:]
    assert ("WORKER megatron_pg_agg.integrations.areal.plugin.PGAggMegatronPPOActor "
            "megatron_pg_agg.integrations.areal.plugin.PGAggMegatronPPOCritic "
            "CLASS areal.engine.megatron_engine MegatronPPOActor "
            "CLASS areal.engine.megatron_engine MegatronPPOCritic 0") in out.stdout, out.stdout[-3000:]


@pytest.mark.optional_stack
def test_a_shape_that_would_cut_a_group_is_refused_naming_areals_keys(monkeypatch):
    require(None if importlib.util.find_spec("areal") else "AReaL is not installed (docs/areal.md)", REQUIRE_AREAL)
    from areal.api.cli_args import GRPOConfig

    from megatron_pg_agg.integrations.areal.plugin import use_pg_agg

    config = GRPOConfig()
    config.actor.backend = "megatron:d2p1t1"  # AReaL's own allocation string: 2 DP ranks
    config.train_dataset.batch_size, config.actor.ppo_n_minibatches = 8, 6
    with pytest.raises(ArealConfigError, match="actor.ppo_n_minibatches=6 .*train_dataset.batch_size=8 over 2 DP"):
        use_pg_agg(config, "prompt_mean")
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(ArealConfigError, match="reads MEGATRON_PG_AGG_AREAL"):
        use_pg_agg(GRPOConfig())



@pytest.mark.optional_stack
def test_areals_critic_hands_its_loss_the_cp_shard_beside_whole_sequences():
    """Why a critic with context parallelism is refused (by reading AReaL 1.0.4, confirmed on its
    own code here): under CP its forward step hands ``_compute_logprobs_and_loss`` this rank's shard
    of the output with the whole micro-batch's inputs and the ``_cp_*`` keys; the actor branch
    reassembles the shards, the critic branch calls the loss on the shard as is."""
    require(None if importlib.util.find_spec("areal") else "AReaL is not installed (docs/areal.md)", REQUIRE_AREAL)
    from megatron_pg_agg.integrations.areal.cpu import apply_areal_cpu_patches

    apply_areal_cpu_patches()
    from areal.engine.megatron_engine import MegatronEngine

    seen = {}

    def loss_fn(values, inputs):
        seen.update(values=tuple(values.shape), returns=tuple(inputs["returns"].shape),
                    cp_keys=sorted(k for k in inputs if k.startswith("_cp_")))
        return values.sum()

    tokens = 16
    inputs = {"returns": torch.zeros(tokens), "values": torch.zeros(tokens), "loss_mask": torch.ones(tokens),
              "_cp_padded_cu_seqlens": torch.tensor([0, tokens]), "_cp_padding_length": 0,
              "_cp_old_cu_seqlens": torch.tensor([0, tokens])}
    engine = SimpleNamespace(config=SimpleNamespace(is_critic=True), enable_tree_training=False)
    shard = torch.zeros(tokens // 2, 1)  # CP rank 0 of 2
    MegatronEngine._compute_logprobs_and_loss(engine, shard, inputs, loss_fn, lambda x: x["loss_mask"].sum(),
                                              torch.tensor(float(tokens)))
    assert seen["values"] == (tokens // 2,) and seen["returns"] == (tokens,), seen
    assert "_cp_padded_cu_seqlens" in seen["cp_keys"], seen


@pytest.mark.optional_stack
def test_a_non_megatron_actor_backend_is_refused_naming_the_key(monkeypatch):
    """actor.backend (AReaL's allocation string, the key its trainer picks the actor class by) naming
    FSDP or Archon: refused by use_pg_agg naming actor.backend (AReaL's trainer would build its own
    FSDP/Archon actor, which the plug-in does not reach: the objective would silently be AReaL's token
    mean); a Megatron backend is accepted."""
    require(None if importlib.util.find_spec("areal") else "AReaL is not installed (docs/areal.md)", REQUIRE_AREAL)
    from areal.api.cli_args import GRPOConfig

    from megatron_pg_agg.integrations.areal.plugin import use_pg_agg

    monkeypatch.delenv(ENV, raising=False)
    for backend in ("fsdp:d2", "archon:d2"):
        config = GRPOConfig()
        config.actor.backend, config.train_dataset.batch_size = backend, 8  # AReaL's ppo_n_minibatches=4 fits
        with pytest.raises(ArealConfigError, match=f"actor.backend={backend}: the plug-in serves AReaL's Megatron"):
            use_pg_agg(config, "prompt_mean")
    from megatron_pg_agg.integrations.areal.plugin import actor_problems

    config = GRPOConfig()
    config.actor.backend, config.train_dataset.batch_size = "megatron:d2p1t1", 8
    assert actor_problems(config.actor, ArealSettings(HostObjective("prompt_mean")), prompts_per_step=8) == []


BUILT_DIRECTLY = """
import os, sys
from megatron_pg_agg.integrations.areal.cpu import apply_areal_cpu_patches
apply_areal_cpu_patches()  # CPU: AReaL's engine module imports megatron.bridge (stood in here)
from areal.api.cli_args import PPOActorConfig, PPOCriticConfig
from areal.api.io_struct import FinetuneSpec
from megatron_pg_agg.integrations.areal.plugin import ENV, ArealConfigError, actor_class, critic_class

def refused(build, *args):
    try:
        build(*args)
    except ArealConfigError as error:
        return str(error).replace(chr(10), " ")
    return "NOT REFUSED"

def critic(**keys):
    return PPOCriticConfig(experiment_name="pg_agg", trial_name="cpu", path="/nonexistent", is_critic=True,
                           **{"backend": "megatron:d1", **keys})

os.environ[ENV] = "seq_mean;group_baseline=response_mean"
print("BASELINE", refused(critic_class(), critic()))
os.environ[ENV] = "seq_mean"
print("BACKEND", refused(critic_class(), critic(backend="fsdp:d1")))
built = critic_class()(critic(backend="megatron:d2", ppo_n_minibatches=4))  # AReaL's engine, nothing built yet
print("MINIBATCHES", refused(built.initialize, None, FinetuneSpec(total_train_epochs=1, dataset_size=60,
                                                                   train_batch_size=6)))
actor = PPOActorConfig(experiment_name="pg_agg", trial_name="cpu", path="/nonexistent", backend="fsdp:d2")
print("ACTOR", refused(actor_class(), actor))
"""


@pytest.mark.optional_stack
def test_the_critic_built_directly_refuses_what_use_pg_agg_refuses():
    """The plug-in's critic class built as a single-controller worker builds it (from its own section,
    with MEGATRON_PG_AGG_AREAL; no use_pg_agg in that process): group_baseline beside a critic and a
    non-Megatron critic.backend are refused by its constructor, an oversized critic.ppo_n_minibatches
    (6 prompts over 2 DP ranks: 3 groups a rank for 4 steps) by its initialize, from AReaL's
    FinetuneSpec, before AReaL builds anything; each naming the key. The actor class likewise refuses
    a non-Megatron actor.backend. In a fresh interpreter (AReaL's engine module is patched for CPU)."""
    require(None if importlib.util.find_spec("areal") else "AReaL is not installed (docs/areal.md)", REQUIRE_AREAL)
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", BUILT_DIRECTLY], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-5000:]
    lines = {line.split(" ", 1)[0]: line for line in out.stdout.splitlines() if " " in line}
    assert "refuses this AReaL critic" in lines.get("BASELINE", ""), out.stdout[-3000:]
    assert "group_baseline=response_mean takes one value per response, but with a critic" in lines["BASELINE"]
    assert "critic.backend=fsdp:d1: the plug-in serves AReaL's Megatron critic" in lines.get("BACKEND", ""), lines
    assert ("critic.ppo_n_minibatches=4 optimizer steps of whole prompt groups need at least 4 groups per DP rank, "
            "but train_dataset.batch_size=6 over 2 DP rank(s) gives 3") in lines.get("MINIBATCHES", ""), lines
    assert "actor.backend=fsdp:d2: the plug-in serves AReaL's Megatron actor" in lines.get("ACTOR", ""), lines


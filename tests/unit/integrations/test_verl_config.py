"""The verl plug-in's configuration: verl's keys and the ``pg_agg`` block -> PGLossConfig (issue 28).

The mapping rules run without verl (plain mappings, as verl's OmegaConf node reads); the last
tests compose verl 0.9.1's own ``ppo_megatron_trainer`` config with the lines docs/verl.md gives,
and check the plug-in is loaded by verl's own entry-point mechanism (Python 3.12 with verl; they
skip elsewhere, and fail under MEGATRON_PG_AGG_REQUIRE_VERL=1).
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_pg_agg.integrations.verl.config import (
    ACTOR,
    BLOCK,
    VerlConfigError,
    engine_problems,
    loss_config_from_verl,
    verl_install_problem,
)
from tests.support.optional import REQUIRE_VERL, require

DOCS = Path(__file__).resolve().parents[3] / "docs" / "verl.md"


def doc_overrides() -> list:
    """The ``key=value`` lines of docs/verl.md's command-line example (between its markers)."""
    block = re.search(r"<!-- verl-overrides -->\n(.*?)<!-- /verl-overrides -->", DOCS.read_text(), re.S).group(1)
    return [token for token in block.split() if "=" in token and not token.startswith("--")]

ACTOR_DEFAULTS = {"strategy": "megatron", "policy_loss": {"loss_mode": "pg_agg"}, "loss_agg_mode": "token-mean",
                  "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0, "entropy_coeff": 0,
                  "use_kl_loss": False, "kl_loss_coef": 0.001, "kl_loss_type": "low_var_kl",
                  "loss_scale_factor": None}


def actor(**changes):
    return {**ACTOR_DEFAULTS, **changes}


def refusal(actor_cfg, block) -> str:
    with pytest.raises(VerlConfigError) as info:
        loss_config_from_verl(actor_cfg, block)
    return str(info.value)


def test_verl_keys_keep_their_meaning():
    cfg = loss_config_from_verl(
        actor(clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=5.0, entropy_coeff=0.01, use_kl_loss=True,
              kl_loss_coef=0.05, kl_loss_type="mse"), {"mode": "prompt_mean"})
    assert (cfg.mode, cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip) == ("prompt_mean", 0.1, 0.28, 5.0)
    assert (cfg.entropy_coef, cfg.kl_coef, cfg.kl_estimator, cfg.policy_loss) == (0.01, 0.05, "k2", "ppo")
    # without use_kl_loss the KL coefficient is 0 whatever kl_loss_coef says (verl's own rule)
    assert loss_config_from_verl(actor(kl_loss_coef=0.5), {}).kl_coef == 0.0
    # the dual clip is verl's vanilla (ppo) rule: other policy losses have none
    assert loss_config_from_verl(actor(), {"policy_loss": "gspo"}).dual_clip is None
    for verl_name, ours in (("kl", "k1"), ("k1", "k1"), ("low_var_kl", "k3"), ("k3", "k3")):
        assert loss_config_from_verl(actor(use_kl_loss=True, kl_loss_type=verl_name), {}).kl_estimator == ours


def test_the_mode_comes_from_the_block_or_from_verl_loss_agg_mode():
    assert loss_config_from_verl(actor(), None).mode == "token_mean"  # verl's default token-mean
    assert loss_config_from_verl(actor(loss_agg_mode="seq-mean-token-mean"), {}).mode == "seq_mean"
    summed = loss_config_from_verl(actor(loss_agg_mode="seq-mean-token-sum"), {})
    assert (summed.mode, summed.divisor) == ("constant", 1.0)
    normed = loss_config_from_verl(actor(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=512), {})
    assert (normed.mode, normed.divisor) == ("constant", 512.0)
    block = loss_config_from_verl(actor(loss_scale_factor=512), {"mode": "constant", "divisor": 64})
    assert block.divisor == 64.0  # the block's own L first
    # the block and a verl value that agree
    assert loss_config_from_verl(actor(loss_agg_mode="seq-mean-token-mean"), {"mode": "seq_mean"}).mode == "seq_mean"


def test_refusals_name_the_verl_keys():
    assert f"{ACTOR}.loss_agg_mode='token-sum'" in refusal(actor(loss_agg_mode="token-sum"), {})
    msg = refusal(actor(loss_agg_mode="seq-mean-token-mean"), {"mode": "prompt_mean"})
    assert f"{BLOCK}.mode='prompt_mean'" in msg and f"{ACTOR}.loss_agg_mode='seq-mean-token-mean'" in msg
    msg = refusal(actor(loss_agg_mode="seq-mean-token-sum-norm"), {})
    assert f"{BLOCK}.divisor" in msg and f"{ACTOR}.loss_scale_factor" in msg
    assert f"{BLOCK}.divisor" in refusal(actor(), {"mode": "constant"})
    assert f"{BLOCK}.mode='mean'" in refusal(actor(), {"mode": "mean"})
    assert f"['{BLOCK}.aggregation']" in refusal(actor(), {"aggregation": "prompt_mean"})
    assert f"{BLOCK}.policy_loss='grpo'" in refusal(actor(), {"policy_loss": "grpo"})
    assert f"{ACTOR}.kl_loss_type='abs'" in refusal(actor(use_kl_loss=True, kl_loss_type="abs"), {})
    assert f"{ACTOR}.policy_loss.loss_mode is 'vanilla'" in refusal(actor(policy_loss={"loss_mode": "vanilla"}), {})
    assert "rollout correction bounds" in refusal(actor(), {"rollout_correction": "token_mask",
                                                            "rollout_correction_max": 0.5,
                                                            "rollout_correction_min": 0.9})
    # every problem at once
    msg = refusal(actor(use_kl_loss=True, kl_loss_type="abs"), {"mode": "mean", "colour": 1})
    assert msg.count("\n  - ") == 3, msg


def _hf_folder(tmp_path, name, **config):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", **config}))
    return str(folder)


def test_dynamic_cp_with_a_moe_model_is_refused_naming_the_key_and_the_upstream_bug(tmp_path):
    """Megatron-LM #7452 finding 10: verl's dynamic context parallelism passes a router padding
    mask, and megatron-core then multiplies the MoE aux-loss gradient by the TP x CP size. Refused
    with a MoE model (Qwen3-MoE's and Mixtral's keys) or one whose config cannot be read; dense
    models and the default (no dynamic CP, no mask) run."""
    moe = _hf_folder(tmp_path, "moe", num_experts=8)
    mixtral = _hf_folder(tmp_path, "mixtral", num_local_experts=4)
    dense = _hf_folder(tmp_path, "dense", num_experts=0)

    def worker(path, dynamic):
        return {"actor": {**ACTOR_DEFAULTS, "megatron": {"dynamic_context_parallel": dynamic}}, "model": {"path": path}}

    for path in (moe, mixtral, "Qwen/Qwen3-30B-A3B"):
        (problem,) = engine_problems(worker(path, True))
        assert f"{ACTOR}.megatron.dynamic_context_parallel=True" in problem and "#7452, finding 10" in problem
    assert engine_problems(worker(dense, True)) == []
    assert engine_problems(worker(moe, False)) == []
    assert engine_problems({"actor": ACTOR_DEFAULTS, "model": {"path": moe}}) == []  # verl's default: off


def test_megatron_fsdp_is_refused_naming_the_key_as_on_every_entry():
    """verl's actor.megatron.use_megatron_fsdp wraps the model in Megatron-FSDP, refused as on the
    Megatron-LM and Bridge entries (Megatron-LM #7452 finding 12); the default (off) runs."""
    fsdp = {"actor": {**ACTOR_DEFAULTS, "megatron": {"use_megatron_fsdp": True}}, "model": {}}
    (problem,) = engine_problems(fsdp)
    assert f"{ACTOR}.megatron.use_megatron_fsdp=True" in problem and "#7452, finding 12" in problem
    assert engine_problems({"actor": {**ACTOR_DEFAULTS, "megatron": {"use_megatron_fsdp": False}}, "model": {}}) == []


def test_install_problem_names_megatron_core_0_19(monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version
    installed = {"verl": "0.9.1", "megatron-bridge": "0.6.2", "tensordict": "0.10.0", "megatron-core": "0.18.2"}
    monkeypatch.setattr(sys, "version_info", SimpleNamespace(major=3, minor=12))
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed.get(name) or real(name))
    problem = verl_install_problem()
    assert "megatron-core 0.19" in problem and "megatron-core 0.18.2" in problem
    installed["megatron-core"] = "0.19.2"
    assert verl_install_problem() is None


def test_install_problem_names_python_3_12_and_the_install_line(monkeypatch):
    monkeypatch.setattr(sys, "version_info", SimpleNamespace(major=3, minor=11))
    problem = verl_install_problem()
    assert "Python 3.12" in problem and "pip install --no-deps megatron-bridge==0.6.2 verl==0.9.1" in problem


def _verl():
    require(verl_install_problem(), REQUIRE_VERL)


def test_the_docs_example_is_the_switch_to_prompt_mean():
    assert doc_overrides() == ["actor_rollout_ref.actor.policy_loss.loss_mode=pg_agg",
                               "+actor_rollout_ref.pg_agg.mode=prompt_mean",
                               "+actor_rollout_ref.pg_agg.policy_loss=ppo",
                               "actor_rollout_ref.actor.clip_ratio_high=0.28",
                               "trainer.use_v1=False"]  # the v0 trainer: prompt groups whole per step


@pytest.mark.optional_stack
def test_docs_lines_compose_with_verl_own_config_and_load_the_plugin():
    """In a fresh interpreter: ``import verl`` loads the plug-in through verl's entry-point
    mechanism (the patch's marker on both targets); verl's own ppo_megatron_trainer config with
    docs/verl.md's command-line lines gives verl's McoreActorConfig and the plug-in's loss; so does
    the GPU config file it ships (launch/verl/grpo_pg_agg.yaml)."""
    _verl()
    code = f"""
import os, verl
from hydra import compose, initialize_config_dir
from megatron_pg_agg.patches import applied_patches
from verl.workers.engine.megatron.transformer_impl import MegatronEngine
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker
from verl.utils.config import omega_conf_to_dataclass
import verl.utils.config
from megatron_pg_agg.integrations.verl.worker_losses import worker_loss
assert applied_patches() == ["verl_engine"], applied_patches()
for fn in (MegatronEngine.forward_backward_batch, ActorRolloutRefWorker.init_model, TrainingWorker.set_loss_fn,
           verl.utils.config.validate_config):
    assert fn._megatron_pg_agg_patch == "verl_engine" and hasattr(fn, "__wrapped__")
configs = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
with initialize_config_dir(config_dir=configs, version_base=None):
    cfg = compose("ppo_megatron_trainer", overrides={doc_overrides()!r} + [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.n=4"])
assert omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).policy_loss.loss_mode == "pg_agg"
loss = worker_loss(cfg.actor_rollout_ref, "actor_rollout")
print("CFG", loss.loss_cfg.mode, loss.loss_cfg.policy_loss, loss.loss_cfg.dual_clip, loss.loss_cfg.clip_eps_high)
assert worker_loss(cfg.actor_rollout_ref, "ref") is None
# the GPU config file docs/verl.md ships (launch/verl/grpo_pg_agg.yaml), on verl's own defaults
with initialize_config_dir(config_dir={str(DOCS.parents[1] / "launch" / "verl")!r}, version_base=None):
    shipped = compose("grpo_pg_agg", overrides=["actor_rollout_ref.model.path=/m", "data.train_files=/t.parquet",
                                                "data.val_files=/v.parquet"])
loss = worker_loss(shipped.actor_rollout_ref, "actor_rollout")
print("SHIPPED", loss.loss_cfg.mode, shipped.algorithm.adv_estimator, shipped.actor_rollout_ref.rollout.n)
"""
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_PLUGINS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "CFG prompt_mean ppo 3.0 0.28" in proc.stdout, proc.stdout
    assert "SHIPPED prompt_mean grpo 8" in proc.stdout, proc.stdout


@pytest.mark.optional_stack
def test_mini_batch_problems_name_the_field():
    """prepare_step on a verl mini-batch: prompt_mean without verl's uid, two corrections at once, a
    correction without the rollout engine's log-probs; each refused naming the field or key."""
    _verl()
    import torch
    from tensordict import TensorDict

    from megatron_pg_agg.core.losses import PGLossConfig
    from megatron_pg_agg.integrations.verl.loss import VerlBatchError, VerlPGLoss

    def mini_batch(**extra):
        return TensorDict({"response_mask": torch.ones(2, 3), "old_log_probs": torch.zeros(2, 3), **extra},
                          batch_size=[2])

    with pytest.raises(VerlBatchError, match="'uid'"):
        VerlPGLoss(PGLossConfig(mode="prompt_mean")).prepare_step(mini_batch())
    corrected = VerlPGLoss(PGLossConfig(mode="seq_mean", rollout_correction="token_mask"))
    with pytest.raises(VerlBatchError, match="rollout_is_weights.*actor_rollout_ref.pg_agg.rollout_correction"):
        corrected.prepare_step(mini_batch(rollout_is_weights=torch.ones(2, 3)))
    with pytest.raises(VerlBatchError, match="'rollout_log_probs'.*calculate_log_probs"):
        corrected.prepare_step(mini_batch())

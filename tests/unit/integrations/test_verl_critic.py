"""verl's critic under the plug-in (issue 46 item 3): its mode from verl's keys, the refusals, and
the critic loss on verl's own micro-batch split against the float64 formulas.

The configuration rules run without verl (plain mappings, as verl's OmegaConf node and its
``CriticConfig`` read); the rest needs verl (Python 3.12; skipped elsewhere, failed under
MEGATRON_PG_AGG_REQUIRE_VERL=1): the loss on mini-batches laid out as verl's trainer hands them
to its engine (``left_right_2_no_padding``, padded or jagged) and cut by verl's own
``prepare_micro_batches`` (fixed sizes, dynamic by tokens), the critic worker's ``set_loss_fn``
seam, and verl's own ``main_ppo`` refusing a critic at start-up.
"""
import copy
import os
import re
import subprocess
import sys
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from megatron_pg_agg.integrations.verl.config import (
    ACTOR,
    CRITIC,
    VerlConfigError,
    critic_for_run,
    value_config_from_critic,
)
from tests.support.optional import REQUIRE_VERL, require
from tests.support.reference import reference_objective
from tests.unit.integrations.test_verl_config import DOCS, actor

CRITIC_DEFAULTS = {"strategy": "megatron", "loss_agg_mode": "token-mean", "loss_scale_factor": None,
                   "cliprange_value": 0.5}
MODES = {"token_mean": None, "seq_mean": None, "prompt_mean": None, "constant": 7.0}


def critic(**changes):
    return {**CRITIC_DEFAULTS, **changes}


def run_config(actor_cfg=None, critic_cfg=None, block=None) -> dict:
    worker = {"actor": actor_cfg or actor(), **({"pg_agg": block} if block is not None else {})}
    return {"actor_rollout_ref": worker, "critic": critic_cfg or critic()}


def refused(config, use_critic=True) -> str:
    with pytest.raises(VerlConfigError) as info:
        critic_for_run(config, use_critic)
    return str(info.value)


# ------------------------------------------------------------------------------ configuration, no verl


def test_a_verl_name_keeps_verl_critic_ours_turns_the_plugin_on():
    """critic.loss_agg_mode with a verl name (token-sum included: verl's own critic) is verl's
    value_loss, untouched (None); one of ours gives the value loss of that mode with verl's
    cliprange_value and 0.5, L of constant from critic.loss_scale_factor."""
    for name in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"):
        assert value_config_from_critic(critic(loss_agg_mode=name)) is None, name
    cfg = value_config_from_critic(critic(loss_agg_mode="prompt_mean", cliprange_value=0.2))
    assert (cfg.mode, cfg.divisor, cfg.clip_eps, cfg.factor) == ("prompt_mean", None, 0.2, 0.5)
    cfg = value_config_from_critic(critic(loss_agg_mode="constant", loss_scale_factor=512))
    assert (cfg.mode, cfg.divisor) == ("constant", 512.0)
    # an inherited loss_scale_factor means nothing to the other modes (verl reads it only for -norm)
    assert value_config_from_critic(critic(loss_agg_mode="seq_mean", loss_scale_factor=512)).divisor is None


def test_critic_refusals_name_the_critic_keys():
    with pytest.raises(VerlConfigError, match=f"{CRITIC}.loss_scale_factor"):
        value_config_from_critic(critic(loss_agg_mode="constant"))
    with pytest.raises(VerlConfigError, match=f"{CRITIC}.strategy='fsdp'"):
        value_config_from_critic(critic(loss_agg_mode="seq_mean", strategy="fsdp"))
    with pytest.raises(VerlConfigError, match=f"{CRITIC}.cliprange_value=0.0"):
        value_config_from_critic(critic(loss_agg_mode="seq_mean", cliprange_value=0.0))


def test_the_actor_off_the_plugin_leaves_verl_critic_alone():
    config = run_config(actor(policy_loss={"loss_mode": "vanilla"}), critic(loss_agg_mode="seq-mean-token-sum-norm"))
    before = copy.deepcopy(config)
    assert critic_for_run(config, True) is None and config == before  # verl's critic, verl's mode
    # ours on the critic alone is checked at start-up
    assert critic_for_run(run_config(actor(policy_loss={"loss_mode": "vanilla"}),
                                     critic(loss_agg_mode="seq_mean")), True) is None
    assert f"{CRITIC}.loss_scale_factor" in refused(run_config(actor(policy_loss={"loss_mode": "vanilla"}),
                                                               critic(loss_agg_mode="constant")))


def test_the_default_is_the_policy_mode_in_the_plugin_terms():
    """The actor on the plug-in: a critic whose loss_agg_mode is the actor's (verl's YAML default,
    it interpolates actor.loss_agg_mode) trains the policy's mode, pg_agg.mode included. Catches
    the critic left on verl's token-mean under a prompt_mean actor (the behaviour without the
    plug-in's start-up step), or the block's L not reaching the critic."""
    config = run_config(block={"mode": "prompt_mean"})
    note = critic_for_run(config, True)
    assert config["critic"]["loss_agg_mode"] == "prompt_mean" and "the policy's mode" in note
    settled = copy.deepcopy(config)
    assert critic_for_run(config, True) is None and config == settled  # again (verl's v0 checks twice): no change
    config = run_config(block={"mode": "constant", "divisor": 64})
    critic_for_run(config, True)
    assert (config["critic"]["loss_agg_mode"], config["critic"]["loss_scale_factor"]) == ("constant", 64)
    # the mode given as verl's loss_agg_mode on both (the YAML's interpolation), through the alias table
    shared = {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 512}
    config = run_config(actor(**shared), critic(**shared))
    critic_for_run(config, True)
    assert (config["critic"]["loss_agg_mode"], config["critic"]["loss_scale_factor"]) == ("constant", 512)
    config = run_config(actor(loss_agg_mode="seq-mean-token-mean"), critic(loss_agg_mode="seq-mean-token-mean"))
    critic_for_run(config, True)
    assert config["critic"]["loss_agg_mode"] == "seq_mean"
    # without a critic nothing is read or written
    config = run_config(block={"mode": "prompt_mean"})
    assert critic_for_run(config, False) is None and config["critic"]["loss_agg_mode"] == "token-mean"


def test_a_critic_mode_of_its_own_is_read_like_the_actor():
    config = run_config(critic_cfg=critic(loss_agg_mode="seq-mean-token-mean"), block={"mode": "prompt_mean"})
    critic_for_run(config, True)
    assert config["critic"]["loss_agg_mode"] == "seq_mean"
    config = run_config(critic_cfg=critic(loss_agg_mode="seq-mean-token-sum"))
    critic_for_run(config, True)
    assert (config["critic"]["loss_agg_mode"], config["critic"]["loss_scale_factor"]) == ("constant", 1)


def test_start_up_refusals_name_the_keys():
    """A critic the plug-in cannot make exact, with the actor on it: every problem names its key.
    seq-mean-token-sum-norm without loss_scale_factor divides by each micro-batch's padded width
    (the engine test's control shows it moving with the split); token-sum has no normaliser."""
    msg = refused(run_config(critic_cfg=critic(loss_agg_mode="seq-mean-token-sum-norm")))
    assert f"{CRITIC}.loss_agg_mode='seq-mean-token-sum-norm' needs L" in msg and f"{CRITIC}.loss_scale_factor" in msg
    assert f"{CRITIC}.loss_agg_mode='token-sum'" in refused(run_config(critic_cfg=critic(loss_agg_mode="token-sum")))
    msg = refused(run_config(critic_cfg=critic(loss_agg_mode="mean")))
    assert f"{CRITIC}.loss_agg_mode='mean' is not a mode" in msg
    assert f"{CRITIC}.strategy='fsdp'" in refused(run_config(critic_cfg=critic(strategy="fsdp")))
    # every problem at once
    msg = refused(run_config(critic_cfg=critic(strategy="fsdp", loss_agg_mode="token-sum")))
    assert msg.count("\n  - ") == 2 and f"{CRITIC}.strategy='fsdp'" in msg, msg
    # the policy's mode inherited: the actor's own problems, named by the actor's keys, at start-up
    msg = refused(run_config(actor(loss_agg_mode="seq-mean-token-sum-norm"),
                             critic(loss_agg_mode="seq-mean-token-sum-norm")))
    assert f"{ACTOR}.loss_scale_factor" in msg


def test_a_megatron_fsdp_critic_is_refused_naming_its_key():
    """critic.megatron.use_megatron_fsdp on the plug-in's critic: refused (Megatron-LM #7452 finding
    12), at the worker's config and at verl's start-up; verl's own critic is not the plug-in's."""
    fsdp = critic(loss_agg_mode="prompt_mean", megatron={"use_megatron_fsdp": True})
    with pytest.raises(VerlConfigError, match=r"critic.megatron.use_megatron_fsdp=True: .*finding 12"):
        value_config_from_critic(fsdp)
    assert "critic.megatron.use_megatron_fsdp=True" in refused(run_config(critic_cfg=fsdp))
    assert value_config_from_critic(critic(megatron={"use_megatron_fsdp": True})) is None


# ------------------------------------------------------------------------------ with verl


def _verl():
    from megatron_pg_agg.integrations.verl.config import verl_install_problem

    require(verl_install_problem(), REQUIRE_VERL)


GROUPS = (3, 2, 3)
PROMPTS = (2, 3, 1, 4, 2, 3, 2, 1)
RESPONSES = (4, 1, 3, 5, 2, 4, 3, 2)
EPS = 0.2


def critic_rows():
    """Eight ragged responses in groups of 3, 2, 3 (one fully masked, one masked token), each with
    a float64 leaf V over its whole sequence (prompt and response), and V_old, R at its response
    tokens (float32 numbers) near V so that the clip is partly active."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for gi, size in enumerate(GROUPS):
        for _ in range(size):
            i = len(rows)
            p, n = PROMPTS[i], RESPONSES[i]
            full = torch.randn(p + n, generator=g, dtype=torch.float64).requires_grad_(True)
            here = full.detach()[p - 1:p + n - 1]
            old = (here + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).float().double()
            ret = (here + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)).float().double()
            mask = [0] * n if i == 3 else [int(not (i == 1 and j == 0)) for j in range(n)]
            rows.append(SimpleNamespace(group_id=f"u{gi}", prompt_ids=[5] * p, response_ids=[7] * n, loss_mask=mask,
                                        old_logprobs=[0.0] * n, advantages=[0.0] * n, old_values=old.tolist(),
                                        returns=ret.tolist(), full=full))
    return rows


def reference(rows, mode, divisor):
    """J_v from the formulas in float64: v = 0.5 max((V-R)^2, (clamp(V, V_old - eps, V_old + eps) - R)^2)
    per response token, aggregated by tests/support/reference.py (the README's contract)."""
    losses, masks = [], []
    for r in rows:
        p, n = len(r.prompt_ids), len(r.response_ids)
        v = r.full[p - 1:p + n - 1]
        old, ret = torch.tensor(r.old_values, dtype=torch.float64), torch.tensor(r.returns, dtype=torch.float64)
        clipped = torch.minimum(torch.maximum(v, old - EPS), old + EPS)
        losses.append(0.5 * torch.maximum((v - ret) ** 2, (clipped - ret) ** 2))
        masks += [bool(m) for m in r.loss_mask]
    mask = torch.tensor(masks)
    return reference_objective(torch.cat(losses), mask, mask, [len(r.response_ids) for r in rows], list(GROUPS),
                               mode, divisor)[0]


def mini_batch(rows, *, jagged, mbs, dynamic):
    from verl.utils import tensordict_utils as tu

    from tests.distributed.workers.verl_checks import batch

    td = batch(rows, list(range(len(rows))), jagged=jagged, mbs=mbs, dynamic=dynamic, fields=("values", "returns"))
    response_mask = td["response_mask"]
    tokens = int(response_mask.values().sum() if response_mask.is_nested else response_mask.sum())
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=tokens, max_token_len_per_gpu=14)
    return td


def run_split(loss_fn, rows, td, prepare=True):
    """verl's own split of the mini-batch (fixed size or dynamic), the loss on each micro-batch with
    V sliced from the rows' leaves as verl's THD output lays it out (prompt and response, row after
    row), summed: J for DP = 1 (verl's engine multiplies each loss by its micro-batch count and
    Megatron's schedule divides by it)."""
    from verl.workers.engine.utils import prepare_micro_batches

    if prepare:
        loss_fn.prepare_step(td)
    micro_batches, indices = prepare_micro_batches(td)
    if indices is None:
        sizes = [len(mb) for mb in micro_batches]
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        indices = [list(range(s, s + n)) for s, n in zip(starts, sizes)]
    total, metrics = torch.zeros((), dtype=torch.float64), []
    for mb, idx in zip(micro_batches, indices):
        values = torch.cat([rows[i].full for i in idx]).float()
        loss, m = loss_fn(model_output={"values": values}, data=mb, dp_group=None)  # as verl calls it
        total = total + loss.double()
        metrics.append(m)
    return total, metrics, len(micro_batches)


SPLITS = [(False, 1, False), (False, 4, False), (True, 2, False), (True, 1, True)]


@pytest.mark.optional_stack
@pytest.mark.parametrize("mode", list(MODES))
def test_critic_loss_on_verl_split_equals_the_float64_formulas(mode):
    """Every mode, padded and jagged, micro-batch sizes 1/2/4 and verl's dynamic split: the summed
    micro-batch losses and their gradient in V equal the float64 reference. Catches a per-micro-
    batch W or denominator, c^v from another mode, V taken at the response token instead of the
    one before it, the clip around R or V, a missing 0.5, or a group pooled in one micro-batch."""
    _verl()
    from megatron_pg_agg.core.value import ValueLossConfig
    from megatron_pg_agg.integrations.verl.loss import VerlValueLoss

    rows = critic_rows()
    want = reference(rows, mode, MODES[mode])
    grads = torch.autograd.grad(want, [r.full for r in rows])
    assert sum(float(g.abs().sum()) for g in grads) > 0
    for jagged, mbs, dynamic in SPLITS:
        loss_fn = VerlValueLoss(ValueLossConfig(mode, MODES[mode], clip_eps=EPS, factor=0.5))
        got, metrics, count = run_split(loss_fn, rows, mini_batch(rows, jagged=jagged, mbs=mbs, dynamic=dynamic))
        assert count > 1  # the objective is cut across micro-batches (groups too, at micro-batch size 1)
        assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-6, abs=1e-8), (jagged, mbs, dynamic)
        reported = sum(float(m["critic/vf_loss"].values[0]) for m in metrics)
        assert reported == pytest.approx(float(want.detach()), rel=1e-6), (jagged, mbs, dynamic)
        clipped = sum(float(m["critic/vf_clipfrac"].values[0]) for m in metrics)
        assert 0.05 < clipped < 0.95, clipped  # both branches of the clipped loss are exercised
        got_grads = torch.autograd.grad(got, [r.full for r in rows])
        for g, w in zip(got_grads, grads):
            assert torch.allclose(g, w, rtol=1e-5, atol=1e-7), (jagged, mbs, dynamic)


@pytest.mark.optional_stack
def test_verl_token_mean_critic_equals_ours_and_its_norm_mode_moves_with_the_split():
    """The control on verl's own value_loss (plug-in off) and the same split: verl's token-mean
    equals our token_mean (value and gradient); verl's seq-mean-token-sum-norm without
    loss_scale_factor, jagged, divides by each micro-batch's longest response, so its objective
    changes with the micro-batch size (why the plug-in refuses it without L)."""
    _verl()
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import McoreCriticConfig
    from verl.workers.utils.losses import value_loss

    rows = critic_rows()
    want = reference(rows, "token_mean", None)
    grads = torch.autograd.grad(want, [r.full for r in rows])
    norm = {}
    for agg in ("token-mean", "seq-mean-token-sum-norm"):
        verl_loss = partial(value_loss, config=McoreCriticConfig(ppo_micro_batch_size_per_gpu=1, loss_agg_mode=agg,
                                                                 cliprange_value=EPS))
        for mbs in (1, 4):
            td = mini_batch(rows, jagged=True, mbs=mbs, dynamic=False)
            tu.assign_non_tensor(td, global_batch_size=len(rows))
            got, _, _ = run_split(verl_loss, rows, td, prepare=False)
            if agg == "token-mean":
                assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
                for g, w in zip(torch.autograd.grad(got, [r.full for r in rows]), grads):
                    assert torch.allclose(g, w, rtol=1e-5, atol=1e-7)
            norm[mbs] = float(got.detach())
    assert abs(norm[1] - norm[4]) > 1e-2 * abs(norm[4]), norm


@pytest.mark.optional_stack
def test_the_critic_worker_set_loss_fn_seam():
    """verl's TrainingWorker.set_loss_fn (patched, verl's @register attributes kept): verl's
    partial(value_loss, config=CriticConfig) with one of our modes becomes the plug-in's critic
    loss; a verl mode, the actor's losses and a non-Megatron critic engine are handled by name."""
    _verl()
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.workers.config import McoreCriticConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithValueHead
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss, value_loss

    from megatron_pg_agg.integrations.verl.loss import VerlValueLoss

    assert getattr(TrainingWorker.set_loss_fn, MAGIC_ATTR)["dispatch_mode"].name == "ONE_TO_ALL"
    assert TrainingWorker.set_loss_fn._megatron_pg_agg_patch == "verl_engine"
    worker = SimpleNamespace(engine=object.__new__(MegatronEngineWithValueHead))

    def config(**kw):
        return McoreCriticConfig(ppo_micro_batch_size_per_gpu=2, **kw)

    TrainingWorker.set_loss_fn(worker, partial(value_loss, config=config(loss_agg_mode="prompt_mean",
                                                                         cliprange_value=0.3)))
    assert isinstance(worker.loss_fn, VerlValueLoss)
    assert (worker.loss_fn.value_cfg.mode, worker.loss_fn.value_cfg.clip_eps) == ("prompt_mean", 0.3)
    TrainingWorker.set_loss_fn(worker, loss_fn=partial(value_loss, config=config(loss_agg_mode="constant",
                                                                                 loss_scale_factor=64)))
    assert worker.loss_fn.value_cfg.divisor == 64.0
    for unchanged in (partial(value_loss, config=config(loss_agg_mode="token-mean")), partial(ppo_loss, config=None)):
        TrainingWorker.set_loss_fn(worker, unchanged)
        assert worker.loss_fn is unchanged
    with pytest.raises(VerlConfigError, match=f"{CRITIC}.loss_scale_factor"):
        TrainingWorker.set_loss_fn(worker, partial(value_loss, config=config(loss_agg_mode="constant")))
    other = SimpleNamespace(engine=object())
    with pytest.raises(VerlConfigError, match=f"{CRITIC}.strategy=megatron"):
        TrainingWorker.set_loss_fn(other, partial(value_loss, config=config(loss_agg_mode="seq_mean")))


def doc_critic_overrides() -> list:
    """The ``key=value`` lines of docs/verl.md's critic example (between its markers)."""
    block = re.search(r"<!-- verl-critic-overrides -->\n(.*?)<!-- /verl-critic-overrides -->", DOCS.read_text(),
                      re.S).group(1)
    return [token for token in block.split() if "=" in token and not token.startswith("--")]


def test_the_docs_critic_example_is_one_critic_line_over_the_actor_lines():
    assert doc_critic_overrides() == ["actor_rollout_ref.actor.policy_loss.loss_mode=pg_agg",
                                      "+actor_rollout_ref.pg_agg.mode=prompt_mean", "critic.loss_agg_mode=seq_mean",
                                      "trainer.use_v1=False"]


START_UP = """
import os, sys, verl
from functools import partial
from types import SimpleNamespace
from hydra import compose, initialize_config_dir
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.workers.engine_workers import TrainingWorker
from verl.workers.utils.losses import value_loss
configs = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
model = os.environ["MODEL"]
common = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
          "actor_rollout_ref.rollout.n=4", "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
          "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
          "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2", "trainer.n_gpus_per_node=2",
          f"actor_rollout_ref.model.path={model}", f"critic.model.path={model}"]
for name, overrides in eval(sys.argv[1]).items():
    with initialize_config_dir(config_dir=configs, version_base=None):
        cfg = compose("ppo_megatron_trainer", overrides=overrides + common)
    assert need_critic(cfg)  # verl's default estimator, GAE
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    critic = omega_conf_to_dataclass(cfg.critic)
    worker = SimpleNamespace(engine=None)
    TrainingWorker.set_loss_fn(worker, partial(value_loss, config=critic))
    value_cfg = getattr(worker.loss_fn, "value_cfg", None)
    print("CRITIC", name, critic.loss_agg_mode, type(worker.loss_fn).__name__, getattr(value_cfg, "mode", None),
          getattr(value_cfg, "divisor", None))
"""


@pytest.mark.optional_stack
def test_verl_start_up_settles_the_critic_mode(tmp_path):
    """In a fresh interpreter (the plug-in loaded by verl's entry point), verl's own
    ppo_megatron_trainer (GAE: a critic) after verl's own validate_config, and the loss its critic
    worker then gets through set_loss_fn: docs/verl.md's actor lines give a prompt_mean critic (the
    policy's mode); its critic line a seq_mean one; a constant block its L; the actor off the
    plug-in keeps verl's value_loss. verl's main_ppo refuses a critic the plug-in cannot make exact
    before starting Ray, naming critic.loss_scale_factor."""
    _verl()
    from tests.unit.integrations.test_verl_config import doc_overrides

    model = str(tmp_path / "qwen3")  # verl's config reads the model's folder; the project's tiny one, no download
    subprocess.run([sys.executable, "-m", "megatron_pg_agg.integrations.bridge.tiny_hf", "--family", "qwen3",
                    "--seed", "3", model], check=True, capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_PLUGINS"}
    env["MODEL"] = model
    runs = {"docs": doc_overrides(), "critic_line": doc_critic_overrides(),
            "constant": ["actor_rollout_ref.actor.policy_loss.loss_mode=pg_agg",
                         "+actor_rollout_ref.pg_agg.mode=constant", "+actor_rollout_ref.pg_agg.divisor=64"],
            "verl": []}
    proc = subprocess.run([sys.executable, "-c", START_UP, repr(runs)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "critic.loss_agg_mode=prompt_mean: the policy's mode" in proc.stdout, proc.stdout
    for line in ("CRITIC docs prompt_mean VerlValueLoss prompt_mean None",
                 "CRITIC critic_line seq_mean VerlValueLoss seq_mean None",
                 "CRITIC constant constant VerlValueLoss constant 64.0",
                 "CRITIC verl token-mean partial None None"):
        assert line in proc.stdout, proc.stdout
    main = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "--config-name=ppo_megatron_trainer",
                           *doc_overrides(), "critic.loss_agg_mode=seq-mean-token-sum-norm"],
                          capture_output=True, text=True, timeout=300, env={**env, "HYDRA_FULL_ERROR": "1"},
                          cwd=tmp_path)  # Hydra writes its outputs/ folder into the working directory
    assert main.returncode != 0
    assert "critic.loss_agg_mode='seq-mean-token-sum-norm' needs L: set critic.loss_scale_factor" in main.stderr, \
        main.stderr[-3000:]
    assert "ray init kwargs" not in main.stdout  # refused before verl starts Ray

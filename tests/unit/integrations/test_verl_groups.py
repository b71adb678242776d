"""prompt_mean under verl's trainer (issue 58 item 3): every optimizer step holds whole prompt groups.

verl's v0 trainer balances the rollout over the DP ranks (``RayPPOTrainer._balance_batch``,
``trainer.balance_batch``), hands each rank a contiguous share (``DataProto.chunk``), and each rank's
worker takes its mini-batches as consecutive slices of it (``tu.make_iterator``, as
``TrainingWorker.train_mini_batch`` calls it): optimizer step k is the k-th slice of every rank. The
tests run verl 0.9.1's own balance, chunk and iterator on a rollout of 8 prompts x 4 responses and
check each step, then the plug-in's prompt_mean step weights (``step_weights.global_layout`` +
``token_weights``, per rank as after its ``all_gather_object``) against the float64 formula: over one
epoch of S steps of M whole groups each, sum_k J_k = S x J_ref, with J_ref the mean over the
rollout's groups of each group's pooled token mean. A group cut across steps counts as a group in
each of them and breaks it. The configuration rules run without verl.
"""
import random
from types import SimpleNamespace

import pytest
import torch

from megatron_pg_agg.core.aggregation import token_weights
from megatron_pg_agg.integrations.step_weights import global_layout
from megatron_pg_agg.integrations.verl.config import ACTOR, VerlConfigError
from megatron_pg_agg.integrations.verl.groups import group_problems, whole_group_partitions
from tests.support.optional import REQUIRE_VERL, require
from tests.unit.integrations.test_verl_config import actor

PROMPTS, N, WIDTH, PROMPT_LEN = 8, 4, 7, 3


def run_config(*, actor_mode="prompt_mean", mini_batch=4, critic_mode="token-mean", critic_mini_batch=None,
               shuffle=False, epochs=1, balance=True, gpus=2, tp=1, critic_tp=None, use_v1=False):
    """The trainer config's keys the balance and the start-up check read (verl's names)."""
    actor_cfg = actor(ppo_mini_batch_size=mini_batch, shuffle=shuffle, ppo_epochs=epochs,
                      megatron={"tensor_model_parallel_size": tp})
    critic_cfg = {"strategy": "megatron", "loss_agg_mode": critic_mode, "cliprange_value": 0.5,
                  "ppo_mini_batch_size": critic_mini_batch or mini_batch, "shuffle": shuffle, "ppo_epochs": epochs,
                  "megatron": {"tensor_model_parallel_size": critic_tp or tp}}
    worker = {"actor": actor_cfg, "rollout": {"n": N}}
    if actor_mode is not None:
        worker["pg_agg"] = {"mode": actor_mode}
    else:
        actor_cfg["policy_loss"] = {"loss_mode": "vanilla"}
    return {"actor_rollout_ref": worker, "critic": critic_cfg, "data": {"train_batch_size": PROMPTS},
            "trainer": {"balance_batch": balance, "n_gpus_per_node": gpus, "nnodes": 1, "use_v1": use_v1}}


# ------------------------------------------------------------------------------ configuration, no verl


def test_start_up_refuses_what_cuts_a_group_naming_the_keys():
    """Several steps per rollout (8 prompts, mini-batch 4) with a shuffle, with verl's order
    (balance off) and a mini-batch that DP does not divide, a critic on another DP size, the v1
    trainer: each refused, naming its keys. One step per rollout, or the default, is not."""
    assert group_problems(run_config(), use_critic=False) == []
    assert group_problems(run_config(shuffle=True, mini_batch=PROMPTS), use_critic=False) == []  # one step
    (shuffled,) = group_problems(run_config(shuffle=True, epochs=2), use_critic=False)
    assert f"{ACTOR}.shuffle=True" in shuffled and f"{ACTOR}.ppo_mini_batch_size=4" in shuffled
    (order,) = group_problems(run_config(balance=False, gpus=8), use_critic=False)
    assert "trainer.balance_batch=False" in order and f"{ACTOR}.ppo_mini_batch_size=4" in order and "DP size 8" in order
    assert group_problems(run_config(balance=False, gpus=4), use_critic=False) == []  # 4 | 4: slices are whole
    critic = run_config(actor_mode=None, critic_mode="prompt_mean", critic_mini_batch=2, gpus=4, critic_tp=2)
    (dp,) = group_problems(critic, use_critic=True)
    assert "critic.ppo_mini_batch_size=2" in dp and "DP size 2" in dp and "actor of DP size 4" in dp
    assert group_problems(critic, use_critic=False) == []  # no critic: nothing in a group mode
    (v1,) = group_problems(run_config(use_v1=True), use_critic=False)
    assert "trainer.use_v1=True" in v1


def test_modes_without_groups_are_not_checked():
    for mode in ("token_mean", "seq_mean"):
        assert group_problems(run_config(actor_mode=mode, shuffle=True, balance=False, gpus=8), True) == []


def test_a_group_that_does_not_fit_a_step_is_refused():
    def partition(workloads, k_partitions, equal_size):
        return [list(range(i, len(workloads), k_partitions)) for i in range(k_partitions)]

    ranks = whole_group_partitions([1] * 6, ["a", "a", "b", "b", "c", "c"], 2, 2, partition)
    assert ranks == [[0, 2, 4], [1, 3, 5]]
    with pytest.raises(ValueError, match="prompt group 'b' \\(3 rows\\) does not fit whole"):
        whole_group_partitions([1] * 6, ["a", "b", "b", "b", "c", "c"], 2, 2, partition)


# ------------------------------------------------------------------------------ with verl


def _verl():
    from megatron_pg_agg.integrations.verl.config import verl_install_problem

    require(verl_install_problem(), REQUIRE_VERL)


def rollout(seed=0):
    """verl's DataProto as the trainer holds it before _balance_batch: PROMPTS x N rows, each
    prompt's responses consecutive under one uid (verl's repeat(interleave=True)), ragged responses
    (attention_mask: prompt + response), a row id, and a float64 loss per response token."""
    from verl import DataProto

    rng = random.Random(seed)
    lengths = [rng.randint(1, WIDTH) for _ in range(PROMPTS * N)]
    response = torch.tensor([[1] * r + [0] * (WIDTH - r) for r in lengths])
    attention = torch.cat([torch.ones(len(lengths), PROMPT_LEN, dtype=torch.int64), response], dim=1)
    uids = [f"p{i // N}" for i in range(len(lengths))]
    loss = torch.tensor([[rng.uniform(-1, 1) for _ in range(WIDTH)] for _ in lengths], dtype=torch.float64)
    batch = DataProto.from_dict(tensors={"attention_mask": attention, "response_mask": response,
                                         "row": torch.arange(len(lengths)), "loss": loss},
                                non_tensors={"uid": uids})
    return batch


def verl_steps(config, dp, term, use_critic):
    """The rows of each optimizer step (one list of row ids per rank) as verl 0.9.1 makes them:
    its _balance_batch (with the plug-in's trainer patch, which its start-up check applies to a
    prompt_mean run) on a trainer holding ``config``, DataProto.chunk over the DP ranks, and each
    rank's tu.make_iterator with train_mini_batch's arguments (mini-batch rows / dp, epochs,
    seed + rank, shuffle)."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils import tensordict_utils as tu

    from megatron_pg_agg.integrations.verl.engine_patch import apply_trainer_patch

    apply_trainer_patch()

    batch = rollout()
    trainer = object.__new__(RayPPOTrainer)  # only what _balance_batch reads
    trainer.config = OmegaConf.create(config)
    trainer.use_critic = use_critic
    trainer.actor_rollout_wg = SimpleNamespace(_dispatch_info={"actor": list(range(dp))})
    trainer._balance_batch(batch, metrics={})
    node = config["critic"] if term == "critic" else config["actor_rollout_ref"]["actor"]
    per_rank = node["ppo_mini_batch_size"] * N // dp
    ranks = []
    for rank, share in enumerate(batch.chunk(dp)):
        rows = tu.get_tensordict({"row": share.batch["row"]})
        loader = tu.make_iterator(rows, mini_batch_size=per_rank, epochs=node["ppo_epochs"], seed=42 + rank,
                                  dataloader_kwargs={"shuffle": node["shuffle"]})
        ranks.append([mini["row"].tolist() for mini in loader])
    return batch, [list(step) for step in zip(*ranks)]


def plugin_objective(full, step):
    """J of one step under the plug-in's prompt_mean step weights: on each rank, its rows' masks and
    every rank's (uids, valid-token counts), as after its all_gather_object."""
    uids, mask, loss = full.non_tensor_batch["uid"], full.batch["response_mask"], full.batch["loss"]
    gathered = [([uids[i] for i in rows], [int(mask[i].sum()) for i in rows]) for rows in step]
    total, weight = 0.0, None
    for rank, rows in enumerate(step):
        local = mask[rows].reshape(-1).to(torch.bool)
        lengths = torch.full((len(rows),), WIDTH, dtype=torch.int64)
        num, den, cu, groups, index = global_layout(local, local, lengths, gathered, rank, True)
        weights = token_weights(num, mode="prompt_mean", divisor=None, cu_seqlens=cu, group_sizes=groups,
                                denominator_mask=den)
        total += float((weights.coef[index].double() * loss[rows].reshape(-1)).sum())
        weight = int(weights.count.sum())
    return total / weight


def reference_objective(full):
    """float64, from the contract: the mean over the rollout's groups of each group's pooled token mean."""
    uids, mask, loss = full.non_tensor_batch["uid"], full.batch["response_mask"].bool(), full.batch["loss"]
    means = []
    for uid in dict.fromkeys(uids):
        rows = [i for i, u in enumerate(uids) if u == uid]
        means.append(float(loss[rows][mask[rows]].sum()) / int(mask[rows].sum()))
    return sum(means) / len(means)


CASES = {  # name: (config, the term whose steps are checked, use_critic)
    "actor": (run_config(), "actor", False),
    "actor_two_epochs": (run_config(epochs=2), "actor", False),
    "critic": (run_config(actor_mode=None, critic_mode="prompt_mean", critic_mini_batch=2), "critic", True),
    "both": (run_config(critic_mode="prompt_mean", critic_mini_batch=2), "critic", True),
    "both_actor": (run_config(critic_mode="prompt_mean", critic_mini_batch=2), "actor", True),
}


@pytest.mark.optional_stack
@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_verl_step_holds_whole_groups_and_prompt_mean_is_exact(case, dp):
    _verl()
    config, term, use_critic = CASES[case]
    config = {**config, "trainer": {**config["trainer"], "n_gpus_per_node": dp}}
    full = rollout()
    _, steps = verl_steps(config, dp, term, use_critic)
    node = config["critic"] if term == "critic" else config["actor_rollout_ref"]["actor"]
    per_epoch = PROMPTS // node["ppo_mini_batch_size"]
    assert len(steps) == per_epoch * node["ppo_epochs"]
    uids = full.non_tensor_batch["uid"]
    for k, step in enumerate(steps):
        rows = [i for rank in step for i in rank]
        cut = sorted({uids[i] for i in rows if sum(uids[j] == uids[i] for j in rows) != N})
        assert not cut, f"step {k} holds part of the groups {cut}"
    reference = reference_objective(full)
    for epoch in range(node["ppo_epochs"]):
        epoch_steps = steps[epoch * per_epoch:(epoch + 1) * per_epoch]
        assert sum(plugin_objective(full, step) for step in epoch_steps) == pytest.approx(
            per_epoch * reference, rel=1e-6, abs=1e-9)


@pytest.mark.optional_stack
@pytest.mark.parametrize("dp", [1, 2])
def test_modes_without_groups_keep_verl_balance(dp):
    """token_mean (the actor on the plug-in) and verl's own loss: the order verl's unwrapped
    _balance_batch gives, row for row."""
    _verl()
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from megatron_pg_agg.integrations.verl.engine_patch import apply_trainer_patch

    apply_trainer_patch()
    original = getattr(RayPPOTrainer._balance_batch, "__wrapped__", RayPPOTrainer._balance_batch)
    for config in (run_config(actor_mode="token_mean"), run_config(actor_mode=None)):
        config = {**config, "trainer": {**config["trainer"], "n_gpus_per_node": dp}}
        batch, _ = verl_steps(config, dp, "actor", False)
        control = rollout()
        trainer = SimpleNamespace(config=None, _get_dp_size=lambda wg, role: dp, actor_rollout_wg=None)
        original(trainer, control, metrics={})
        assert batch.batch["row"].tolist() == control.batch["row"].tolist()


@pytest.mark.optional_stack
def test_verl_start_up_refuses_a_shuffled_prompt_mean_run():
    """verl's own validate_config (as the plug-in wraps it) on verl's own ppo_megatron_trainer
    config: prompt_mean with actor.shuffle over 4 steps per rollout is refused naming the keys, so is
    verl's default v1 trainer;
    without the shuffle it passes and verl's trainer balances whole groups (the patch applied)."""
    _verl()
    from hydra import compose, initialize_config_module
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils import config as verl_config

    overrides = ["actor_rollout_ref.actor.policy_loss.loss_mode=pg_agg", "+actor_rollout_ref.pg_agg.mode=prompt_mean",
                 "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"]
    v0 = "trainer.use_v1=False"  # verl 0.9.1's default is the v1 trainer, refused with several steps per rollout
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        shuffled = compose(config_name="ppo_megatron_trainer",
                           overrides=[*overrides, v0, "actor_rollout_ref.actor.shuffle=True"])
        v1 = compose(config_name="ppo_megatron_trainer", overrides=overrides)
        config = compose(config_name="ppo_megatron_trainer", overrides=[*overrides, v0])
    with pytest.raises(VerlConfigError, match="actor_rollout_ref.actor.shuffle=True with 4 optimizer steps"):
        verl_config.validate_config(shuffled, use_reference_policy=False, use_critic=False)
    with pytest.raises(VerlConfigError, match="trainer.use_v1=True with 4 optimizer steps"):
        verl_config.validate_config(v1, use_reference_policy=False, use_critic=False)
    verl_config.validate_config(config, use_reference_policy=False, use_critic=False)
    assert RayPPOTrainer._balance_batch.__name__ == "_balance_batch"
    assert "balance_whole_groups" in RayPPOTrainer._balance_batch.__code__.co_names


def test_worker_steps_name_the_groups_they_cut():
    """cut_by_worker_steps: rank 0 holds a, a, b, b; rank 1 b, b, c, c; steps of 2 rows per rank:
    step 0 = a, a, b, b (whole), step 1 = b, b, c, c: b over both steps. One step, nothing; a shuffle
    over several steps, every group."""
    from megatron_pg_agg.integrations.verl.groups import cut_by_worker_steps

    gathered = [["a", "a", "b", "b"], ["b", "b", "c", "c"]]
    assert cut_by_worker_steps(gathered, 2, False) == ["group b over steps [0, 1]"]
    assert cut_by_worker_steps([["a", "a", "b", "b"], ["c", "c", "d", "d"]], 2, False) == []
    assert cut_by_worker_steps(gathered, 4, True) == []
    assert len(cut_by_worker_steps(gathered, 2, True)) == 3


@pytest.mark.optional_stack
def test_the_worker_refuses_steps_that_cut_a_group():
    """verl's TrainingWorker.train_mini_batch (as the plug-in wraps it) on a rollout in verl's own
    balanced order, with a prompt_mean loss of the plug-in: refused before any step, naming the keys;
    with verl's own loss it goes on to verl (which then needs its engine). The plug-in's order passes
    the check."""
    _verl()
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import TrainingWorker

    from megatron_pg_agg.core.losses import PGLossConfig
    from megatron_pg_agg.integrations.verl.groups import balance_whole_groups, check_worker_steps
    from megatron_pg_agg.integrations.verl.loss import VerlBatchError, VerlPGLoss

    def worker_batch(balance):
        batch = rollout()
        trainer = SimpleNamespace(config=None, _get_dp_size=lambda wg, role: 1, actor_rollout_wg=None)
        balance(trainer, batch, metrics={})
        data = batch.to_tensordict()
        tu.assign_non_tensor(data, mini_batch_size=4 * N, dataloader_kwargs={"shuffle": False})
        return data

    original = getattr(RayPPOTrainer._balance_batch, "__wrapped__", RayPPOTrainer._balance_batch)
    engine = SimpleNamespace(get_data_parallel_size=lambda: 1, get_data_parallel_group=lambda: None)
    worker = SimpleNamespace(loss_fn=VerlPGLoss(PGLossConfig(mode="prompt_mean")), engine=engine)
    with pytest.raises(VerlBatchError, match=r"cut \d+ of them .*trainer.balance_batch=True.*"
                                             r"actor_rollout_ref.actor.ppo_mini_batch_size"):
        TrainingWorker.train_mini_batch(worker, worker_batch(original))
    config = run_config()
    trainer = SimpleNamespace(config=config, use_critic=False, _get_dp_size=lambda wg, role: 1, actor_rollout_wg=None)
    check_worker_steps(worker, worker_batch(lambda _, batch, metrics: balance_whole_groups(trainer, batch, metrics,
                                                                                           "global_seqlen")))
    worker.loss_fn = VerlPGLoss(PGLossConfig(mode="token_mean"))
    check_worker_steps(worker, worker_batch(original))  # no groups: nothing checked

"""Whole prompt groups in every optimizer step of verl's trainer, for prompt_mean (host only).

WHY
    prompt_mean's step weights (:mod:`megatron_pg_agg.integrations.step_weights`) treat the rows of
    one ``uid`` in a step as the whole group. verl's v0 trainer (``RayPPOTrainer``) hands each DP rank
    a contiguous share of the rollout, and each rank's worker (``TrainingWorker.train_mini_batch``,
    ``tu.make_iterator``) takes its mini-batches as consecutive slices of that share: optimizer step
    k is the k-th slice of every rank. verl's ``_balance_batch`` (``trainer.balance_batch``, on by
    default) partitions the rows over the ranks by workload and sorts each rank's rows by length, so
    with more than one mini-batch per rollout (``data.train_batch_size`` > ``ppo_mini_batch_size``) a
    group lands in several steps. Shuffling (``shuffle``) permutes each rank's rows on its own seed.

HOW
    The group-mode terms (the actor under the plug-in in prompt_mean, a prompt_mean critic) each take
    ``M x rollout.n`` rows per step. :func:`whole_group_partitions` cuts the rollout into blocks of
    ``G = gcd`` of those row counts, each block whole groups in their rollout order, balances each
    block's rows over the DP ranks with verl's own partitioner (equal sizes; verl's in-rank order by
    workload), and gives rank r its part of block 0, block 1, ...: step k of every group-mode term is
    then whole blocks on every rank. A group may span ranks inside a step (the step weights gather
    over DP). :func:`balance_whole_groups` is what the engine patch's ``_balance_batch`` runs in
    place of verl's when a term is in a group mode; other modes keep verl's balance, unchanged.

    What cannot be kept whole is refused at verl's start-up check (:func:`group_problems`): a
    shuffled term with several steps, ``trainer.balance_batch=False`` with a mini-batch that is not
    a multiple of the DP size (so does verl's prefix grouper), a critic whose DP size differs from
    the actor's, the v1 trainer. Whatever the driver (one of your own, or one that skipped verl's
    start-up check), each worker checks the steps it is about to take before the first of them
    (:func:`check_worker_steps`, from the engine patch's ``TrainingWorker.train_mini_batch``): a cut
    group stops the run there, naming the keys.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from megatron_pg_agg.core.modes import PROMPT_MEAN
from megatron_pg_agg.integrations.step_weights import cut_groups, gather_over_dp
from megatron_pg_agg.integrations.verl.config import ACTOR, BLOCK, CRITIC, LOSS_MODE, _get, loss_config_from_verl

BALANCE = "trainer.balance_batch"
GROUP_KEY = "uid"
"""verl's prompt-group key in the rollout's non-tensor batch."""


@dataclass(frozen=True)
class GroupTerm:
    """A term trained in a group mode (prompt_mean) and how verl cuts its rollout into steps."""

    key: str
    """verl's node of the term: ``actor_rollout_ref.actor`` or ``critic``."""
    mini_batch: int
    """Prompts per optimizer step (``<key>.ppo_mini_batch_size``)."""
    steps: int
    """Optimizer steps per rollout and epoch: ``data.train_batch_size // mini_batch``."""
    shuffle: bool
    """``<key>.shuffle``: verl's worker permutes each rank's rows per epoch."""
    dp: int
    """The term's Megatron DP size: GPUs // (TP x PP x CP of ``<key>.megatron``)."""


def _dp(config: Any, node: Any) -> int:
    trainer, megatron = _get(config, "trainer"), _get(node, "megatron")
    gpus = int(_get(trainer, "n_gpus_per_node", 1)) * int(_get(trainer, "nnodes", 1))
    model = 1
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        model *= int(_get(megatron, key, 1) or 1)
    return max(gpus // model, 1)


def group_terms(config: Any, use_critic: bool) -> list:
    """The :class:`GroupTerm` of each term of the run trained in prompt_mean (the actor under the
    plug-in; the critic once its mode is settled: ``critic.loss_agg_mode``), else none."""
    worker = _get(config, "actor_rollout_ref")
    actor, critic = _get(worker, "actor"), _get(config, CRITIC)
    nodes = []
    if _get(_get(actor, "policy_loss"), "loss_mode") == LOSS_MODE \
            and loss_config_from_verl(actor, _get(worker, "pg_agg")).mode == PROMPT_MEAN:
        nodes.append((ACTOR, actor))
    if use_critic and _get(critic, "loss_agg_mode") == PROMPT_MEAN:
        nodes.append((CRITIC, critic))
    prompts = int(_get(_get(config, "data"), "train_batch_size"))
    return [GroupTerm(key, int(_get(node, "ppo_mini_batch_size")), prompts // int(_get(node, "ppo_mini_batch_size")),
                      bool(_get(node, "shuffle", False)), _dp(config, node)) for key, node in nodes]


def group_problems(config: Any, use_critic: bool) -> list:
    """What keeps prompt_mean's groups from staying whole in every optimizer step, each naming its
    verl keys (verl's start-up check refuses the run with them). One step per rollout is always
    whole (the worker's shuffle then only reorders rows inside the step)."""
    terms = [t for t in group_terms(config, use_critic) if t.steps > 1]
    trainer = _get(config, "trainer")
    balance = bool(_get(trainer, "balance_batch", True))
    grouper = bool(_get(_get(_get(config, "actor_rollout_ref"), "actor"), "use_prefix_grouper", False))
    actor_dp = _dp(config, _get(_get(config, "actor_rollout_ref"), "actor"))
    problems = []
    for t in terms:
        size = f"{t.key}.ppo_mini_batch_size={t.mini_batch}"
        steps = f"{t.steps} optimizer steps per rollout (data.train_batch_size / {size}) under prompt_mean"
        if _get(trainer, "use_v1", False):
            problems.append(f"trainer.use_v1=True with {steps}: the v1 trainer's _balance_batch spreads a prompt group "
                            f"over several steps and the plug-in does not keep it whole there; use the v0 trainer "
                            f"(trainer.use_v1=False) or set {size} to data.train_batch_size")
        if t.shuffle:
            problems.append(f"{t.key}.shuffle=True with {steps}: verl's worker shuffles each DP rank's rows on its "
                            f"own seed, which spreads a prompt group over several steps; set {t.key}.shuffle=False "
                            f"(epochs then repeat the same whole-group steps) or {size} to data.train_batch_size")
        if (not balance or grouper) and t.mini_batch % t.dp:
            why = f"{BALANCE}=False" if not balance else f"{ACTOR}.use_prefix_grouper=True (verl's own group balance)"
            problems.append(f"{why} with {size} not a multiple of the DP size {t.dp} ({steps}): each rank's "
                            f"mini-batch of {t.mini_batch}/{t.dp} prompts' rows cuts a prompt group; set "
                            f"{BALANCE}=True without the prefix grouper (the plug-in then balances whole groups) or "
                            f"{size} to a multiple of {t.dp}")
        if balance and not grouper and t.key == CRITIC and t.dp != actor_dp:
            problems.append(f"{BALANCE}=True with a critic of DP size {t.dp} and an actor of DP size {actor_dp} "
                            f"({steps}): the rollout is balanced over the actor's ranks, which cuts the critic's "
                            f"prompt groups across its steps; give critic.megatron the actor's TP x PP x CP or set "
                            f"{size} to data.train_batch_size")
    return problems


def _block_groups(uids: Sequence, block_rows: int, why: str) -> list:
    """The rollout's rows as blocks of ``block_rows`` rows made of whole ``uid`` groups, in the
    order of first appearance. Raises ValueError when a group does not fit whole."""
    members: dict = {}
    for i, uid in enumerate(uids):
        members.setdefault(uid, []).append(i)
    blocks, current = [], []
    for uid, rows in members.items():
        current = current + rows
        if len(current) > block_rows:
            raise ValueError(f"prompt group {uid!r} ({len(rows)} rows) does not fit whole in an optimizer step of "
                             f"{block_rows} rows ({why}): prompt_mean needs whole groups in every step")
        if len(current) == block_rows:
            blocks.append(current)
            current = []
    if current:
        raise ValueError(f"the rollout's {len(uids)} rows are not whole steps of {block_rows} rows ({why})")
    return blocks


def whole_group_partitions(workloads: Sequence[int], uids: Sequence, block_rows: int, dp: int,
                           partition: Callable, *, why: str = "") -> list:
    """Each DP rank's rows, in order, such that every slice of ``k x block_rows / dp`` rows of every
    rank together holds whole ``uid`` groups. ``partition(workloads, k_partitions, equal_size)`` is
    verl's ``get_seqlen_balanced_partitions``; inside a rank's part of a block the rows are ordered
    as verl orders a rank (by workload, small ones at both ends)."""
    if block_rows % dp:
        raise ValueError(f"a step of {block_rows} rows does not split over {dp} DP ranks ({why})")
    ranks = [[] for _ in range(dp)]
    for block in _block_groups(uids, block_rows, why):
        parts = partition([workloads[i] for i in block], k_partitions=dp, equal_size=True)
        for rank, part in zip(ranks, parts):
            rows = sorted((block[j] for j in part), key=lambda i: (workloads[i], i))
            rank.extend(rows[::2] + rows[1::2][::-1])
    return ranks


def block_rows(config: Any, use_critic: bool) -> Optional[int]:
    """The rows of one block (the gcd of the group-mode terms' rows per step), None without a
    group-mode term."""
    terms = group_terms(config, use_critic)
    if not terms:
        return None
    n = int(_get(_get(_get(config, "actor_rollout_ref"), "rollout"), "n", 1))
    return math.gcd(*(t.mini_batch * n for t in terms))


def balance_whole_groups(trainer: Any, batch: Any, metrics: dict, prefix: str) -> bool:
    """verl's ``_balance_batch`` for a run with a group-mode term: reorder ``batch`` (verl's
    DataProto, in place, as verl's) so that its DP shares hold whole groups in every step, and log
    verl's balance metrics. Returns False, touching nothing, when no term is in a group mode or the
    batch has no ``uid``, or under verl's prefix grouper (its own group balance keeps groups whole on
    one rank; :func:`group_problems` refuses the mini-batch sizes it cuts): verl's balance then runs."""
    import torch  # noqa: PLC0415
    from verl.utils.seqlen_balancing import (  # noqa: PLC0415
        calculate_workload,
        get_seqlen_balanced_partitions,
        log_seqlen_unbalance,
    )

    rows = block_rows(trainer.config, bool(getattr(trainer, "use_critic", False)))
    if rows is None or GROUP_KEY not in batch.non_tensor_batch or getattr(trainer, "use_prefix_grouper", False):
        return False
    mask = batch.batch["attention_mask"]
    seqlens = mask.view(mask.shape[0], -1).sum(-1)
    workloads = calculate_workload(seqlens).tolist()
    dp = trainer._get_dp_size(trainer.actor_rollout_wg, "actor")
    why = (f"the gcd of the prompt_mean terms' ppo_mini_batch_size x rollout.n; {BALANCE}, "
           f"{ACTOR}.ppo_mini_batch_size, {BLOCK}.mode")
    ranks = whole_group_partitions(workloads, list(batch.non_tensor_batch[GROUP_KEY]), rows, dp,
                                   get_seqlen_balanced_partitions, why=why)
    batch.reorder(torch.tensor([i for rank in ranks for i in rank]))
    metrics.update(log_seqlen_unbalance(seqlen_list=seqlens.tolist(), partitions=ranks, prefix=prefix))
    return True


def cut_by_worker_steps(gathered: list, rows_per_step: int, shuffle: bool) -> list:
    """The prompt groups verl's workers would cut, as ``"group <uid> over steps [...]"``:
    ``gathered`` holds every DP rank's ``uid`` per row (its share of the rollout, in order), each rank
    taking steps of ``rows_per_step`` consecutive rows (``tu.make_iterator`` without shuffle). With
    ``shuffle`` and several steps the order is not known here: every group counts as cut."""
    steps_per_rank = len(gathered[0]) // rows_per_step if rows_per_step else 0
    if steps_per_rank <= 1:
        return []  # one step: a shuffle only reorders rows inside it
    if shuffle:
        return [f"group {uid} over steps [shuffled]" for uid in dict.fromkeys(u for rank in gathered for u in rank)]
    steps, uids = [[] for _ in range(steps_per_rank)], []
    for rank in gathered:
        for i, uid in enumerate(rank):
            steps[i // rows_per_step].append(len(uids))
            uids.append(uid)
    return cut_groups(steps, uids, len(uids))


def check_worker_steps(worker: Any, data: Any) -> None:
    """Before verl's ``TrainingWorker.train_mini_batch`` takes its steps: under a prompt_mean loss of
    the plug-in, gather every DP rank's ``uid`` rows (one ``all_gather_object``, host lists) and raise
    :class:`~megatron_pg_agg.integrations.verl.loss.VerlBatchError` naming the keys when a step would
    hold part of a group. Other losses and modes: nothing."""
    from verl.utils import tensordict_utils as tu  # noqa: PLC0415

    from megatron_pg_agg.integrations.verl.loss import GROUP_KEY as UID  # noqa: PLC0415
    from megatron_pg_agg.integrations.verl.loss import VerlBatchError, VerlPGLoss, VerlStepLoss  # noqa: PLC0415

    loss = getattr(worker, "loss_fn", None)
    if not isinstance(loss, VerlStepLoss) or loss.mode != PROMPT_MEAN or UID not in data.keys():
        return
    engine, rows = worker.engine, data.shape[0]
    dp = engine.get_data_parallel_size()
    mini_batch, count = tu.get(data, "mini_batch_size"), tu.get(data, "num_mini_batch")
    per_rank = mini_batch // dp if mini_batch is not None else rows // max(int(count or 1), 1)
    shuffle = bool((tu.get(data, "dataloader_kwargs") or {}).get("shuffle", False))
    uids = [str(u) for u in tu.get(data, UID)]
    gathered, _ = gather_over_dp(uids, engine.get_data_parallel_group())
    cut = cut_by_worker_steps(gathered, per_rank, shuffle)
    if cut:
        key = ACTOR if isinstance(loss, VerlPGLoss) else CRITIC
        raise VerlBatchError(
            f"prompt_mean needs whole prompt groups in every optimizer step, and this rollout's steps of "
            f"{per_rank} rows per DP rank cut {len(cut)} of them ({'; '.join(cut[:3])}): keep {BALANCE}=True and "
            f"run verl's start-up check (verl.utils.config.validate_config) in the trainer's process, where the "
            f"plug-in balances whole groups, or make {key}.ppo_mini_batch_size hold the whole rollout; "
            f"{key}.shuffle=False")

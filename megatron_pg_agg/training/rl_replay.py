"""Recorded rollouts replayed into Megatron-LM's RL loop in place of its environments.

``--pg-replay-rollouts FILE`` (or ``builtin``) makes every rollout collection of a
``launch/train_rl_actor.py`` run come from a file instead of Megatron-LM's environments and
inference engine: for reproducing a collection, for tests and benchmarks on machines without a
GPU, and for comparing loss functions on the same data. Everything after the rollouts stays
Megatron-LM's (its advantages, log-prob passes, checkpoints and logging).

The file is JSON Lines, one rollout per line, in the fields of Megatron-LM's ``TokenRollout``::

    {"group": "p0", "trajectory": [1, 17, 5, 9, 126], "generation_mask": [0, 0, 1, 1, 1],
     "reward": 1.0, "logprobs": [-0.7, -1.2, -0.1]}

* ``group``: the prompt group; the rollouts of a group are consecutive lines, exactly
  ``--grpo-group-size`` of them.
* ``trajectory``: prompt and completion token ids (one turn); ``generation_mask``: 1 on the
  generated tokens, which follow the prompt (the first token is not generated); a trajectory
  shorter than ``--seq-length`` ends in the tokenizer's end-of-document token (Megatron-LM checks).
* ``reward``: a number; ``logprobs``: the inference engine's log-prob of each generated token
  (used by ``--rl-inference-logprobs-is-correction``). Required on every line: Megatron-LM
  core_v0.19's RL loop reads them for every rollout (``rl_utils``: ``rollout.logprobs[turn_idx]``)
  and fails on every rank without them, with or without the correction.

Collection ``c`` replays groups ``c*P .. c*P + P - 1`` (``P = --grpo-prompts-per-step``), cycling
through the file. Every rank reads the same file, so every rank gets the same groups (Megatron-LM
broadcasts its environments' rollouts from rank 0).
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Optional

BUILTIN = "builtin"


class ReplayError(ValueError):
    """A replay file that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class RecordedRollout:
    """One rollout of a replay file (host data)."""

    group: str
    trajectory: tuple
    generation_mask: tuple
    reward: float
    logprobs: tuple
    """The inference engine's log-prob of each generated token (Megatron-LM reads them for every rollout)."""


def load_replay(path: str, *, group_size: int, vocab_size: int, seq_length: int) -> list:
    """The file's groups, each a list of ``group_size`` :class:`RecordedRollout`; raises
    ReplayError naming the first bad line."""
    groups: list = []
    with open(path) as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    if not lines:
        raise ReplayError(f"{path}: no rollouts")
    for n, line in lines:
        where = f"{path} line {n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ReplayError(f"{where}: not JSON ({err.msg})") from None
        rollout = _rollout(record, where, vocab_size=vocab_size, seq_length=seq_length)
        if groups and groups[-1][0].group == rollout.group and len(groups[-1]) < group_size:
            groups[-1].append(rollout)
            continue
        if groups and len(groups[-1]) != group_size:
            raise ReplayError(_short_group(path, groups[-1], group_size))
        if any(g[0].group == rollout.group for g in groups):
            raise ReplayError(f"{where}: group {rollout.group!r} appears again after other groups; "
                              "write a group's rollouts on consecutive lines")
        groups.append([rollout])
    if len(groups[-1]) != group_size:
        raise ReplayError(_short_group(path, groups[-1], group_size))
    return groups


def _short_group(path: str, group: list, group_size: int) -> str:
    return (f"{path}: group {group[0].group!r} has {len(group)} rollouts, --grpo-group-size is "
            f"{group_size}; every group needs exactly that many (GRPO's advantages are per group)")


def _rollout(record, where: str, *, vocab_size: int, seq_length: int) -> RecordedRollout:
    if not isinstance(record, dict):
        raise ReplayError(f"{where}: expected an object with group, trajectory, generation_mask, reward")
    missing = [k for k in ("group", "trajectory", "generation_mask", "reward") if k not in record]
    if missing:
        raise ReplayError(f"{where}: missing {', '.join(missing)}")
    tokens, mask = record["trajectory"], record["generation_mask"]
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ReplayError(f"{where}: trajectory must be a list of token ids")
    if not isinstance(mask, list) or len(mask) != len(tokens) or not all(m in (0, 1, True, False) for m in mask):
        raise ReplayError(f"{where}: generation_mask must be a list of 0/1, one per trajectory token")
    if bad := [t for t in tokens if not 0 <= t < vocab_size]:
        raise ReplayError(f"{where}: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    if len(tokens) > seq_length:
        raise ReplayError(f"{where}: {len(tokens)} tokens, more than --seq-length {seq_length}")
    generated = [i for i, m in enumerate(mask) if m]
    if not generated:
        raise ReplayError(f"{where}: no generated token (generation_mask is all 0)")
    if generated[0] == 0:
        raise ReplayError(f"{where}: the first token is generated; a trajectory starts with its prompt")
    reward = record["reward"]
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ReplayError(f"{where}: reward must be a finite number")
    logprobs = record.get("logprobs")
    if logprobs is None:
        raise ReplayError(f"--pg-replay-rollouts {where}: no 'logprobs': Megatron-LM core_v0.19's RL loop reads "
                          "the inference engine's log-prob of every generated token of every rollout "
                          "(rl_utils: rollout.logprobs[turn_idx]) and fails without them, with or without "
                          "--rl-inference-logprobs-is-correction; give one log-prob <= 0 per generated token")
    if (not isinstance(logprobs, list) or len(logprobs) != len(generated)
            or not all(isinstance(v, (int, float)) and math.isfinite(v) and v <= 0 for v in logprobs)):
        raise ReplayError(f"{where}: logprobs must be one finite log-prob <= 0 per generated token "
                          f"({len(generated)})")
    return RecordedRollout(str(record["group"]), tuple(tokens), tuple(bool(m) for m in mask), float(reward),
                           tuple(float(v) for v in logprobs))


def builtin_replay(*, num_groups: int, group_size: int, seq_length: int, eod: int, pad: Optional[int] = None,
                   bos: Optional[int] = None, seed: int = 0) -> list:
    """A small deterministic set: ragged prompts and completions (each ending in ``eod``; token
    ids below ``eod``, never ``pad`` or ``bos``; a trajectory starts with ``bos`` when given),
    rewards that differ inside every group, inference log-probs. The groups of
    :func:`load_replay`'s form."""
    rng = random.Random(seed)
    longest = max(4, min(seq_length, 48))
    ids = [t for t in range(1, eod) if t not in (pad, bos)]
    head = [] if bos is None else [bos]
    groups = []
    for g in range(num_groups):
        prompt = head + [rng.choice(ids) for _ in range(rng.randint(2, max(2, longest // 4)))]
        group = []
        for _ in range(group_size):
            completion = [rng.choice(ids) for _ in range(rng.randint(0, longest - len(prompt) - 1))] + [eod]
            group.append(RecordedRollout(
                f"builtin-{g}", tuple(prompt + completion), (False,) * len(prompt) + (True,) * len(completion),
                float(rng.choice((0.0, 0.25, 1.0))) + 0.01 * len(completion),
                tuple(-rng.uniform(0.05, 3.0) for _ in completion)))
        groups.append(group)
    return groups


def token_rollout(recorded: RecordedRollout):
    """Megatron-LM's ``TokenRollout`` for one recorded rollout (one turn, policy epoch 0)."""
    from megatron.rl.agent.api import TokenRollout

    fields = dict(trajectory=[list(recorded.trajectory)], reward=recorded.reward,
                  generation_mask=[list(recorded.generation_mask)],
                  logprobs=[list(recorded.logprobs)],
                  env_id="replay", problem_id=recorded.group,
                  policy_epoch=[[(0, 0)]], kv_cache_epoch=[[(0, 0)]], num_evictions=[0])
    return TokenRollout(**{k: v for k, v in fields.items() if k in TokenRollout.model_fields})


class ReplaySource:
    """The rollout source registered with ``patches.megatron_rl.set_rollout_source``: ``groups``,
    or ``make_groups(tokenizer)`` called at the first collection (the built-in set needs the
    tokenizer's eod, pad and bos ids, known once Megatron-LM built it)."""

    def __init__(self, groups: Optional[list] = None, make_groups=None, convert=None, collection_index=None):
        self.groups, self.make_groups = groups, make_groups
        self.convert = convert or token_rollout
        """A recorded rollout into what Megatron-LM's loop takes (its ``TokenRollout``)."""
        self.collection_index = collection_index
        """``() -> c``, the collection being made (a resumed run continues the file where the
        interrupted one was); None: counted from 0 by this source."""
        self.collections = 0

    def __call__(self, *, model, inference_model, optimizer, n_prompts: int, samples_per_group: int):
        if self.groups is None:
            from megatron.training import get_tokenizer

            self.groups = self.make_groups(get_tokenizer())
        collection = self.collection_index() if self.collection_index is not None else self.collections
        self.collections += 1
        start = collection * n_prompts
        picked = [self.groups[(start + i) % len(self.groups)] for i in range(n_prompts)]
        return [[self.convert(r) for r in group] for group in picked]

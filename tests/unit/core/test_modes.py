"""Mode names: aliases resolve in one place, and the alias table (docs/peer-aliases.md) says what
the code does.

The peers' formulas below are written by hand in float64 Python from their source
(docs/peer-aliases.md names the files): verl's ``agg_loss`` with the mini-batch's global info, TRL's
``GRPOTrainer._compute_loss`` per device micro-batch, divided by the accumulation steps and averaged
over processes (what DDP does to the gradient).
"""
import argparse
import math
import pathlib
import re

import pytest
import torch

from megatron_pg_agg import ALIASES, MODES, add_pg_agg_args, aggregate, resolve_mode
from megatron_pg_agg.core.modes import REFUSED_ALIASES, mode_choices

ALIAS_TABLE = pathlib.Path(__file__).resolve().parents[3] / "docs" / "peer-aliases.md"
ROW = re.compile(
    r"^\| `([a-z_-]+)` \| (\w+) \| (?:`(\w+)`(?:, divisor (\w+))?|(refused)) \| (.*) \|$"
)


def _alias_table_rows():
    text = ALIAS_TABLE.read_text()
    section = text[text.index("| alias | source | resolves to | differences |"):]
    return {m.group(1): m.groups()[1:] for m in map(ROW.match, section.splitlines()) if m}


def test_canonical_modes_resolve_to_themselves():
    for mode in MODES:
        divisor = 3.0 if mode == "constant" else None
        assert resolve_mode(mode, divisor) == (mode, divisor)


def test_alias_table_matches_the_code():
    rows = _alias_table_rows()
    assert set(rows) == set(ALIASES) | set(REFUSED_ALIASES), "docs/peer-aliases.md and modes.py differ"
    assert not set(ALIASES) & set(REFUSED_ALIASES)
    for name, (source, mode, divisor, refused, differences) in rows.items():
        if refused:
            refusal = REFUSED_ALIASES[name]
            assert refusal.source == source and differences == refusal.note, name
            with pytest.raises(ValueError):
                resolve_mode(name)
            continue
        alias = ALIASES[name]
        assert alias.source == source and alias.mode == mode, name
        assert differences == (alias.note or "none"), name
        if alias.policy_loss is not None:
            assert f"`--pg-policy-loss {alias.policy_loss}`" in differences, name
        if divisor == "required":
            assert alias.divisor_required
            with pytest.raises(ValueError, match="divisor"):
                resolve_mode(name)
            assert resolve_mode(name, 512) == (mode, 512.0)
        elif divisor is not None:
            assert resolve_mode(name) == (mode, float(divisor))
        else:
            assert resolve_mode(name) == (mode, None)


def test_policy_losses_named_by_aliases_exist():
    from megatron_pg_agg.core.losses import POLICY_LOSSES

    for name, alias in ALIASES.items():
        assert alias.policy_loss is None or alias.policy_loss in POLICY_LOSSES, name


@pytest.mark.parametrize("name", sorted(REFUSED_ALIASES))
def test_refused_alias_says_why_and_what_to_use(name):
    refusal = REFUSED_ALIASES[name]
    for divisor in (None, 1.0):
        with pytest.raises(ValueError) as info:
            resolve_mode(name, divisor)
        message = str(info.value)
        assert f"mode={name!r}" in message and refusal.source in message
        assert "cannot be mapped" in message and refusal.why in message
        assert "Closest explicit choice: " + refusal.closest in message
    loss, mask = torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="cannot be mapped"):
        aggregate(loss, mask, mode=name)


def test_token_sum_message_names_the_closest_choice():
    message = REFUSED_ALIASES["token-sum"].error("token-sum").args[0]
    assert "no normaliser" in message and "mode='constant', divisor=1" in message


def test_flag_parser_refuses_a_refused_alias_with_the_reason(capsys):
    parser = add_pg_agg_args(argparse.ArgumentParser(allow_abbrev=False))
    assert "token-sum" in mode_choices()
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--pg-loss-aggregation", "token-sum"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--pg-loss-aggregation='token-sum'" in err and "cannot be mapped" in err
    assert "--pg-loss-aggregation='constant', --pg-loss-aggregation-divisor=1" in err
    for name in ("bnpo", "cispo", "sapo", "vespo", "luspo"):
        assert parser.parse_args(["--pg-loss-aggregation", name]).pg_loss_aggregation == name


def test_missing_divisor_names_the_peers_parameter():
    with pytest.raises(ValueError, match="max_completion_length"):
        resolve_mode("dr_grpo")
    with pytest.raises(ValueError, match="loss_scale_factor"):
        resolve_mode("seq-mean-token-sum-norm")


def test_alias_gives_the_same_objective_as_its_mode():
    loss = torch.tensor([[1.0, 3, 0, 0], [2, 4, 6, 0], [10, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]])
    for name, alias in ALIASES.items():
        divisor = 4 if alias.divisor_required else None
        canonical, canonical_divisor = resolve_mode(name, divisor)
        assert torch.equal(aggregate(loss, mask, mode=name, divisor=divisor)[0],
                           aggregate(loss, mask, mode=canonical, divisor=canonical_divisor)[0]), name


# --- the peers' formulas, by hand, in float64 ----------------------------------------------------
# A toy step: 8 responses (rows), padded to S = 5, split into 2 processes x 2 accumulation steps of
# 2 rows each (TRL), or 2 DP ranks x 2 micro-batches (verl). Row 5 is empty; row 2 has a token
# filtered from the numerator that stays in the denominator (TRL's mask_truncated_completions /
# tool mask, verl's batch_num_tokens from the unfiltered loss_mask).
S = 5
LOSS = [
    [0.3, -1.2, 0.7, 2.0, 9.0],
    [1.5, 0.4, 0.0, 0.0, 0.0],
    [-0.8, 2.2, 1.1, -0.3, 0.6],
    [0.9, 0.0, 0.0, 0.0, 0.0],
    [2.5, -1.7, 0.2, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0, 0.0],
    [0.1, 0.8, -2.4, 1.9, 0.0],
    [-0.6, 1.3, 0.0, 0.0, 0.0],
]
DEN = [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0],
       [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
NUM = [list(r) for r in DEN]
NUM[2][3] = 0  # filtered: numerator only
PROCESSES, ACCUMULATION, ROWS_PER_MICRO = 2, 2, 2


def _micro_batches(rows):
    """[process][accumulation step] -> list of row indices (the order TRL / verl would split)."""
    per_process = len(rows) // PROCESSES
    return [[rows[p * per_process + k * ROWS_PER_MICRO: p * per_process + (k + 1) * ROWS_PER_MICRO]
             for k in range(ACCUMULATION)] for p in range(PROCESSES)]


def _masked_sum(rows, mask):
    return sum(LOSS[i][t] * mask[i][t] for i in rows for t in range(S))


def _row_sum(i, mask):
    return sum(LOSS[i][t] * mask[i][t] for t in range(S))


def _count(i, mask):
    return sum(mask[i])


def _step_objective(micro_loss, rows):
    """What DDP + gradient accumulation optimise: sum over accumulation steps, mean over processes."""
    return sum(micro_loss(mb) for process in _micro_batches(rows) for mb in process) / PROCESSES


def verl(mode, rows, loss_scale_factor=None):
    """verl agg_loss per micro-batch with the mini-batch's global info (engine path)."""
    dp_size = PROCESSES
    batch_num_tokens = sum(_count(i, DEN) for i in rows)  # from the (unfiltered) loss_mask
    global_batch_size = len(rows)  # ppo_mini_batch_size * rollout.n

    def micro(mb):
        if mode == "token-mean":
            return _masked_sum(mb, NUM) / batch_num_tokens * dp_size
        if mode == "token-sum":
            return _masked_sum(mb, NUM) * dp_size
        if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
            seq = sum(_row_sum(i, NUM) for i in mb if _count(i, NUM) > 0)
            loss = seq / global_batch_size * dp_size
            return loss / loss_scale_factor if mode == "seq-mean-token-sum-norm" else loss
        if mode == "seq-mean-token-mean":
            seq = sum(_row_sum(i, NUM) / (_count(i, NUM) + 1e-8) for i in mb if _count(i, NUM) > 0)
            return seq / global_batch_size * dp_size
        raise ValueError(mode)

    return _step_objective(micro, rows)


def trl(loss_type, rows, max_completion_length=None):
    """TRL GRPOTrainer._compute_loss per device micro-batch (token losses given per token; for luspo
    the sequence loss is the row's constant token loss)."""
    num_items_in_batch = sum(_count(i, DEN) for i in rows)  # generation batch = this step

    def micro(mb):
        if loss_type in ("grpo", "sapo"):
            return sum(_row_sum(i, NUM) / max(_count(i, NUM), 1) for i in mb) / len(mb) / ACCUMULATION
        if loss_type == "bnpo":
            return _masked_sum(mb, NUM) / max(sum(_count(i, NUM) for i in mb), 1) / ACCUMULATION
        if loss_type == "dr_grpo":
            return _masked_sum(mb, NUM) / (len(mb) * max_completion_length) / ACCUMULATION
        if loss_type in ("dapo", "cispo", "vespo"):
            return _masked_sum(mb, NUM) / (num_items_in_batch / PROCESSES)
        if loss_type == "luspo":  # (per_token_loss * mask.sum(1)).mean(), per_token_loss (B, 1)
            return sum(SEQUENCE_LOSS[i] * _count(i, NUM) for i in mb) / len(mb) / ACCUMULATION
        raise ValueError(loss_type)

    return _step_objective(micro, rows)


SEQUENCE_LOSS = [0.4, -1.1, 0.25, 2.0, -0.7, 0.0, 1.3, -0.05]


def ours(name, rows, divisor=None, sequence_level=False, counted_before_filtering=True):
    """Our objective with the masks of docs/peer-aliases.md: the peer's final mask as ``loss_mask``
    and, where the peer counts tokens before filtering, that mask as ``denominator_mask`` (else the
    same mask)."""
    loss = torch.tensor([[SEQUENCE_LOSS[i]] * S if sequence_level else LOSS[i] for i in rows],
                        dtype=torch.float64)
    num = torch.tensor([NUM[i] for i in rows], dtype=torch.bool)
    den = torch.tensor([(DEN if counted_before_filtering else NUM)[i] for i in rows], dtype=torch.bool)
    return float(aggregate(loss, num, mode=name, divisor=divisor, denominator_mask=den)[0])


def _active(rows):
    return sum(_count(i, DEN) > 0 for i in rows)


ALL = list(range(8))
NO_EMPTY = [0, 1, 2, 3, 4, 6, 7, 1]  # row 5 swapped for a second copy of row 1: 8 rows, none empty


def test_alias_families_cover_every_alias():
    assert set(FAMILIES) | {"token-sum"} == set(ALIASES) | set(REFUSED_ALIASES)


FAMILIES = {
    "token-mean": "verl", "dapo": "trl", "cispo": "trl", "vespo": "trl",
    "seq-mean-token-mean": "verl", "grpo": "trl", "sapo": "trl",
    "seq-mean-token-sum": "verl", "seq-mean-token-sum-norm": "verl", "dr_grpo": "trl",
    "luspo": "trl", "bnpo": "trl",
}


@pytest.mark.parametrize("name", ["token-mean", "dapo", "cispo", "vespo"])
def test_token_mean_family_equals_the_peer_formula(name):
    """docs/peer-aliases.md "none" (verl token-mean; TRL dapo at its default, and the same normaliser
    for cispo and vespo): equal on a step with an empty response and a filtered token."""
    peer = verl(name, ALL) if FAMILIES[name] == "verl" else trl(name, ALL)
    assert ours(name, ALL) == pytest.approx(peer, rel=1e-12)


@pytest.mark.parametrize("name", ["seq-mean-token-mean", "grpo", "sapo"])
def test_seq_mean_family_differs_exactly_as_the_table_says(name):
    """The peers normalise each row by its final mask: one mask here too."""
    peer = verl if FAMILIES[name] == "verl" else trl
    mine = lambda rows: ours(name, rows, counted_before_filtering=False)  # noqa: E731
    assert mine(NO_EMPTY) == pytest.approx(peer(name, NO_EMPTY), rel=1e-6)
    # with an empty response: peer's J = ours x active / rows
    assert mine(ALL) * _active(ALL) / len(ALL) == pytest.approx(peer(name, ALL), rel=1e-6)
    assert not math.isclose(mine(ALL), peer(name, ALL), rel_tol=1e-3)


@pytest.mark.parametrize("name,divisor", [("seq-mean-token-sum", None), ("seq-mean-token-sum-norm", 7.0),
                                          ("dr_grpo", 7.0)])
def test_constant_family_differs_exactly_as_the_table_says(name, divisor):
    if name == "dr_grpo":
        peer = lambda rows: trl(name, rows, max_completion_length=divisor)  # noqa: E731
    else:
        peer = lambda rows: verl(name, rows, loss_scale_factor=divisor)  # noqa: E731
    mine = lambda rows: ours(name, rows, divisor, counted_before_filtering=False)  # noqa: E731
    assert mine(NO_EMPTY) == pytest.approx(peer(NO_EMPTY), rel=1e-6)
    assert mine(ALL) * _active(ALL) / len(ALL) == pytest.approx(peer(ALL), rel=1e-6)
    assert not math.isclose(mine(ALL), peer(ALL), rel_tol=1e-3)


def test_luspo_is_a_token_sum_per_completion_with_a_sequence_level_token_loss():
    """TRL luspo with a (B, 1) sequence loss = constant, divisor 1 over that loss repeated on every
    token (what --pg-policy-loss gspo gives with one advantage per sequence)."""
    mine = lambda rows: ours("luspo", rows, sequence_level=True, counted_before_filtering=False)  # noqa: E731
    assert mine(NO_EMPTY) == pytest.approx(trl("luspo", NO_EMPTY), rel=1e-6)
    scaled = mine(ALL) * _active(ALL) / len(ALL)
    assert scaled == pytest.approx(trl("luspo", ALL), rel=1e-6)


def test_bnpo_differs_exactly_as_the_table_says():
    """TRL normalises bnpo by each micro-batch's final mask: one mask here too."""
    mine = lambda rows: ours("bnpo", rows, counted_before_filtering=False)  # noqa: E731
    even = [0, 1, 6, 7, 2, 1, 4, 4]  # every micro-batch (2 rows) holds 6 valid tokens
    assert mine(even) == pytest.approx(trl("bnpo", even), rel=1e-12)
    # otherwise TRL's J is a mean of micro-batch token means
    assert not math.isclose(mine(ALL), trl("bnpo", ALL), rel_tol=1e-3)


def test_token_sum_closest_choice_is_what_the_message_says():
    """verl token-sum = constant, divisor 1 x active responses = token_mean x valid tokens."""
    peer = verl("token-sum", ALL)
    assert ours("constant", ALL, divisor=1) * _active(ALL) == pytest.approx(peer, rel=1e-6)
    assert ours("token_mean", ALL) * sum(_count(i, DEN) for i in ALL) == pytest.approx(peer, rel=1e-12)

"""The RL entry's host-side pieces, without Megatron-LM: the collection shape checks, the loss-flag
translation, the cut of a collection into optimizer steps, and the replay file."""
from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from megatron_pg_agg.training.megatron_rl import translate_loss_flags
from megatron_pg_agg.training.rl_collection import CollectionShape, shape_problems, step_batches
from megatron_pg_agg.training.rl_replay import ReplayError, ReplaySource, builtin_replay, load_replay

# ----------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("prompts,group,batch", [(4, 2, 4), (8, 4, 8), (3, 4, 12), (6, 2, 12)])
def test_whole_groups_per_step_are_accepted(prompts, group, batch):
    assert shape_problems(CollectionShape(prompts, group, batch, 2)) == []


def test_a_batch_that_is_not_a_multiple_of_the_group_size_is_refused_naming_the_flags():
    (problem,) = shape_problems(CollectionShape(prompts=3, group_size=4, global_batch=6, passes=2))
    assert "--global-batch-size 6 is not a multiple of --grpo-group-size 4" in problem
    assert "--global-batch-size 4 or 8" in problem


def test_a_collection_that_is_not_whole_steps_is_refused_naming_the_flags():
    # Megatron-LM accepts it ((P*G*iterations) % B == 0) and then trains some groups twice a pass
    (problem,) = shape_problems(CollectionShape(prompts=3, group_size=2, global_batch=4, passes=2))
    assert "--grpo-prompts-per-step 3 x --grpo-group-size 2 = 6" in problem
    assert "a multiple of 2" in problem


# ----------------------------------------------------------------------------- flags


def _args(**given):
    defaults = dict(grpo_clamp_eps_lower=0.01, grpo_clamp_eps_upper=0.01, grpo_kl_beta=0.001,
                    grpo_entropy_term_weight=0.0, rl_inference_logprobs_is_correction=False,
                    rl_importance_sampling_truncation_coef=None, pg_clip_eps=0.2, pg_clip_eps_high=None,
                    pg_kl_coef=0.0, pg_kl_estimator="k3", pg_rollout_correction=None,
                    pg_rollout_correction_max=2.0)
    return argparse.Namespace(**{**defaults, **given})


def test_megatron_lms_defaults_are_translated_and_printed():
    args = _args()
    lines, problems = translate_loss_flags(args, [])
    assert problems == []
    assert (args.pg_clip_eps, args.pg_clip_eps_high, args.pg_kl_coef) == (0.01, 0.01, 0.001)
    assert "--grpo-kl-beta 0.001 (its default) -> --pg-kl-coef 0.001" in lines


def test_a_given_megatron_flag_is_translated_with_its_value():
    args = _args(grpo_clamp_eps_upper=0.28)
    lines, problems = translate_loss_flags(args, ["--grpo-clamp-eps-upper", "0.28"])
    assert problems == [] and args.pg_clip_eps_high == 0.28
    assert "--grpo-clamp-eps-upper 0.28 -> --pg-clip-eps-high 0.28" in lines


def test_an_explicit_pg_flag_wins_and_two_values_are_refused():
    args = _args(pg_clip_eps=0.2)
    assert translate_loss_flags(args, ["--pg-clip-eps", "0.2"])[1] == [] and args.pg_clip_eps == 0.2
    args = _args(grpo_clamp_eps_lower=0.1, pg_clip_eps=0.2)
    (problem,) = translate_loss_flags(args, ["--grpo-clamp-eps-lower", "0.1", "--pg-clip-eps=0.2"])[1]
    assert "--grpo-clamp-eps-lower 0.1 and --pg-clip-eps 0.2" in problem


def test_the_sampled_token_entropy_term_is_refused_naming_the_project_flag():
    (problem,) = translate_loss_flags(_args(grpo_entropy_term_weight=0.1), [])[1]
    assert "-p log p of the sampled token" in problem and "--pg-entropy-coef" in problem


def test_the_is_correction_becomes_token_truncate_with_the_cap():
    args = _args(rl_inference_logprobs_is_correction=True, rl_importance_sampling_truncation_coef=2.5)
    lines, problems = translate_loss_flags(args, [])
    assert problems == [] and (args.pg_rollout_correction, args.pg_rollout_correction_max) == ("token_truncate", 2.5)
    args = _args(rl_inference_logprobs_is_correction=True)
    translate_loss_flags(args, [])
    assert args.pg_rollout_correction_max == math.inf  # untruncated, as Megatron-LM without the coef


def test_a_truncation_without_the_correction_and_a_conflicting_correction_are_refused():
    (problem,) = translate_loss_flags(_args(rl_importance_sampling_truncation_coef=2.0), [])[1]
    assert "without --rl-inference-logprobs-is-correction" in problem
    args = _args(rl_inference_logprobs_is_correction=True, pg_rollout_correction="sequence_mask")
    (problem,) = translate_loss_flags(args, ["--pg-rollout-correction", "sequence_mask"])[1]
    assert "token_truncate" in problem


def test_another_kl_estimator_needs_its_coefficient_explicitly():
    (problem,) = translate_loss_flags(_args(pg_kl_estimator="k1"), [])[1]
    assert "--pg-kl-coef explicitly" in problem


# ----------------------------------------------------------------------------- steps


def test_a_collection_is_cut_into_steps_of_whole_groups_with_megatron_lms_log_prob_alignment():
    """Row i: prompt = tokens before the first generated one; response token j at position p reads
    Megatron-LM's log-prob row at p - 1; the pad id is masked as in Megatron-LM."""
    pad = 9
    tokens = torch.tensor([[1, 2, 3, 4, pad, pad], [1, 5, 6, 9, 7, pad],
                           [2, 3, 4, 5, 6, 8], [2, 7, pad, pad, pad, pad]])
    gen = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0],
                        [0, 0, 0, 1, 1, 1], [0, 1, 0, 0, 0, 0]], dtype=torch.bool)
    lengths = torch.tensor([4, 5, 6, 2])
    old = torch.arange(4 * 5, dtype=torch.float32).reshape(4, 5) * -0.01  # position p-1 of row i: -(5i + p - 1)/100
    steps = step_batches(tokens=tokens, generation_mask=gen, lengths=lengths, pad=pad,
                         advantages=torch.tensor([0.5, -0.5, 1.0, -1.0], dtype=torch.float64),
                         old_logprobs=old, ref_logprobs=old * 2, rollout_logprobs=None,
                         shape=CollectionShape(prompts=2, group_size=2, global_batch=2, passes=1))
    assert len(steps) == 2
    first, second = steps
    assert first.prompt_lengths.tolist() == [2, 1] and first.response_lengths.tolist() == [2, 4]
    assert first.response_tokens.tolist() == [3, 4, 5, 6, 9, 7]
    assert first.loss_mask.tolist() == [True, True, True, True, False, True]  # the pad id 9 is not trained on
    assert torch.allclose(first.old_logprobs, torch.tensor([-0.01, -0.02, -0.05, -0.06, -0.07, -0.08]))
    assert torch.allclose(first.ref_logprobs, 2 * first.old_logprobs)
    assert first.advantages.tolist() == [0.5, 0.5, -0.5, -0.5, -0.5, -0.5]
    assert first.group_index.tolist() == [0, 0] and second.group_index.tolist() == [1, 1]
    assert second.prompt_lengths.tolist() == [3, 1] and second.response_tokens.tolist() == [5, 6, 8, 7]
    assert torch.allclose(second.old_logprobs, torch.tensor([-0.12, -0.13, -0.14, -0.15]))
    assert first.rollout_logprobs is None


# ----------------------------------------------------------------------------- replay files


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _rec(group, n_prompt=2, n_gen=2, **extra):
    return {"group": group, "trajectory": list(range(1, n_prompt + n_gen + 1)),
            "generation_mask": [0] * n_prompt + [1] * n_gen, "reward": 1.0,
            **({"logprobs": [-0.5] * n_gen} if "logprobs" not in extra and n_gen else {}), **extra}


def test_a_replay_file_gives_its_groups_in_order_and_cycles(tmp_path):
    path = _write(tmp_path / "r.jsonl", [_rec("a"), _rec("a"), _rec("b", 3, 1), _rec("b")])
    groups = load_replay(str(path), group_size=2, vocab_size=100, seq_length=16)
    assert [[r.group for r in g] for g in groups] == [["a", "a"], ["b", "b"]]
    source = ReplaySource(groups, convert=lambda r: r)
    taken = [[g[0].group for g in source(model=None, inference_model=None, optimizer=None, n_prompts=3,
                                         samples_per_group=2)] for _ in range(2)]
    assert taken == [["a", "b", "a"], ["b", "a", "b"]]  # collection c: groups c*P .. c*P + P - 1, cycling
    resumed = ReplaySource(groups, convert=lambda r: r, collection_index=lambda: 1)  # a run resumed mid-file
    assert [g[0].group for g in resumed(model=None, inference_model=None, optimizer=None, n_prompts=3,
                                        samples_per_group=2)] == ["b", "a", "b"]


@pytest.mark.parametrize("records,needle", [
    ([_rec("a")], "group 'a' has 1 rollouts, --grpo-group-size is 2"),
    ([_rec("a"), _rec("b"), _rec("b"), _rec("a")], "group 'a' has 1 rollouts"),
    ([_rec("a"), _rec("a"), _rec("b"), _rec("b"), _rec("a"), _rec("a")], "appears again"),
    ([_rec("a", n_prompt=0), _rec("a")], "the first token is generated"),
    ([_rec("a", reward=float("nan")), _rec("a")], "finite"),
    ([_rec("a", logprobs=[-1.0]), _rec("a", logprobs=[-1.0, -1.0])],
     "one finite log-prob <= 0 per generated token (2)"),
    ([_rec("a", logprobs=[-1.0, -1.0]), _rec("a", logprobs=None)],
     "line 2: no 'logprobs': Megatron-LM core_v0.19's RL loop reads"),
    ([_rec("a", n_prompt=20), _rec("a")], "more than --seq-length 16"),
])
def test_a_bad_replay_file_is_refused_naming_the_line(tmp_path, records, needle):
    path = _write(tmp_path / "r.jsonl", records)
    with pytest.raises(ReplayError) as err:
        load_replay(str(path), group_size=2, vocab_size=100, seq_length=16)
    assert needle in str(err.value)


def test_the_builtin_set_is_ragged_and_avoids_the_special_ids():
    groups = builtin_replay(num_groups=6, group_size=4, seq_length=64, eod=126, pad=125, bos=1, seed=3)
    lengths = {len(r.trajectory) for g in groups for r in g}
    assert len(groups) == 6 and all(len(g) == 4 for g in groups) and len(lengths) > 5
    for g in groups:
        assert len({r.reward for r in g}) > 1
        for r in g:
            assert r.trajectory[0] == 1 and r.trajectory[-1] == 126 and max(r.trajectory) <= 126
            assert 125 not in r.trajectory and 1 not in r.trajectory[1:] and len(r.trajectory) <= 64
            assert len(r.logprobs) == sum(r.generation_mask)


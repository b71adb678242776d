"""The NeMo-RL plug-in's settings, start-up refusals and driver-side fields (no NeMo-RL needed), and
its hand-over to NeMo-RL's objects (with the checkout: tests marked optional_stack)."""
from __future__ import annotations

import inspect
import pickle
import random
from types import SimpleNamespace

import pytest
import torch

from megatron_pg_agg.integrations.nemo_rl.plugin import NemoRLConfigError, config_problems, settings_from_config
from megatron_pg_agg.integrations.nemo_rl.weights import (
    ADVANTAGE_SCALE,
    NLL_SCALE,
    STEP_SEQUENCES,
    STEP_TOKENS,
    NemoRLBatchError,
    NemoRLSettings,
    prompt_groups,
    step_fields,
)
from megatron_pg_agg.integrations.objective import HostObjective
from tests.support.nemo_rl_reference import random_batch
from tests.support.optional import require_nemo_rl


def _config(pg_agg=None, **parts):
    loss_fn = SimpleNamespace(pg_agg=pg_agg)
    policy = {"train_global_batch_size": 8, "megatron_cfg": {"enabled": True}}
    grpo = SimpleNamespace(seq_logprob_error_threshold=None, num_generations_per_prompt=4)
    return SimpleNamespace(**{"loss_fn": loss_fn, "policy": policy, "grpo": grpo, "data_plane": None, **parts})


def test_the_objective_comes_from_loss_fn_pg_agg():
    assert settings_from_config(_config({"mode": "prompt_mean"})) == NemoRLSettings(HostObjective("prompt_mean"))
    assert settings_from_config(_config({"mode": "seq-mean-token-sum", "seq_logprob_error_threshold": 1.5})) == \
        NemoRLSettings(HostObjective("constant", 1.0), 1.5)
    with pytest.raises(NemoRLConfigError, match=r"\+\+loss_fn.pg_agg.mode=prompt_mean"):
        settings_from_config(_config())
    with pytest.raises(NemoRLConfigError, match=r"unknown key\(s\) \['mod'\]"):
        settings_from_config(_config({"mod": "token_mean"}))
    with pytest.raises(NemoRLConfigError, match="loss_fn.pg_agg=.*needs divisor"):
        settings_from_config(_config({"mode": "constant"}))
    with pytest.raises(NemoRLConfigError, match="seq_logprob_error_threshold must be a positive"):
        settings_from_config(_config({"mode": "token_mean", "seq_logprob_error_threshold": -1}))


def test_a_scalar_pg_agg_is_refused_naming_the_key():
    """``++loss_fn.pg_agg=prompt_mean`` (a value, not a block): refused naming loss_fn.pg_agg and the
    override to write instead (it was dict()'s raw "dictionary update sequence element #0", naming
    no key)."""
    for value in ("prompt_mean", 5, ["mode", "prompt_mean"]):
        with pytest.raises(NemoRLConfigError, match=r"loss_fn.pg_agg=.* is not a block: loss_fn.pg_agg must be "
                                                    r"a block of keys \['mode', 'divisor', 'seq_logprob_error_th"):
            settings_from_config(_config(value))
    with pytest.raises(NemoRLConfigError, match=r"e.g. \+\+loss_fn.pg_agg.mode=prompt_mean \(not "):
        settings_from_config(_config("prompt_mean"))


def test_check_config_runs_every_start_up_check():
    """check_config (use_pg_agg's checks, and the launcher's before setup()): the settings on an
    accepted config; the block's own refusal; every config problem at once, naming the keys."""
    from megatron_pg_agg.integrations.nemo_rl.plugin import check_config

    assert check_config(_config({"mode": "prompt_mean"})) == NemoRLSettings(HostObjective("prompt_mean"))
    with pytest.raises(NemoRLConfigError, match="loss_fn.pg_agg='prompt_mean' is not a block"):
        check_config(_config("prompt_mean"))
    bad = _config({"mode": "prompt_mean"}, data_plane={"enabled": True},
                  policy={"train_global_batch_size": 6, "megatron_cfg": {"enabled": False}})
    with pytest.raises(NemoRLConfigError) as refused:
        check_config(bad)
    for key in ("data_plane.enabled=true", "policy.megatron_cfg.enabled is false",
                "policy.train_global_batch_size=6 is not a multiple of grpo.num_generations_per_prompt=4"):
        assert key in str(refused.value), str(refused.value)


def test_start_up_refusals_name_nemo_rls_keys():
    """The data plane, a non-Megatron policy, grpo.seq_logprob_error_threshold (the survivor
    denominator) and, for prompt_mean, a step size that cuts a group: each refused naming the key; the
    default GRPO shape is accepted."""
    prompt = HostObjective("prompt_mean")
    assert config_problems(_config(), prompt) == []
    problems = config_problems(_config(data_plane={"enabled": True},
                                       policy={"train_global_batch_size": 6, "megatron_cfg": {"enabled": False}},
                                       grpo=SimpleNamespace(seq_logprob_error_threshold=1.5,
                                                            num_generations_per_prompt=4)), prompt)
    assert [p.split(" ")[0] for p in problems] == ["data_plane.enabled=true:", "policy.megatron_cfg.enabled",
                                                   "grpo.seq_logprob_error_threshold=1.5", "prompt_mean"]
    assert "loss_fn.pg_agg.seq_logprob_error_threshold=1.5 instead" in problems[2]
    assert "policy.train_global_batch_size=6" in problems[3] and "grpo.num_generations_per_prompt=4" in problems[3]
    assert config_problems(_config(policy={"train_global_batch_size": 6, "megatron_cfg": {"enabled": True}}),
                           HostObjective("seq_mean")) == []


def _two_rows():
    """Two responses to the same 2-token prompt, 3 and 1 valid tokens, after a column 0 NeMo-RL never
    scores; a third row with sample_mask 0."""
    token_mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0]], dtype=torch.float32)
    return token_mask, torch.tensor([1.0, 1.0, 0.0])


@pytest.mark.parametrize("mode, token_level, sequence_level", [
    # k_t = c_t G / W at token level (G = 4 valid tokens), c_t M_i S / W at sequence level (S = 2)
    ("token_mean", [1, 1, 1, 1], [3 * 2 / 4, 3 * 2 / 4, 3 * 2 / 4, 1 * 2 / 4]),
    ("seq_mean", [4 / 3 / 2, 4 / 3 / 2, 4 / 3 / 2, 4 / 1 / 2], [1, 1, 1, 1]),
    ("prompt_mean", [1, 1, 1, 1], [3 * 2 / 4, 3 * 2 / 4, 3 * 2 / 4, 2 / 4]),
    ("constant", [4 / 8 / 2] * 4, [3 * 2 / 8 / 2] * 3 + [2 / 8 / 2]),
])
def test_the_advantage_scale_by_hand(mode, token_level, sequence_level):
    """Both rows in one group; constant with L = 8. Catches G, S, W or M_i read from the wrong place,
    or a scale written outside the row's valid tokens (column 0, holes, the sample_mask-0 row)."""
    token_mask, sample_mask = _two_rows()
    objective = HostObjective(mode, 8.0 if mode == "constant" else None)
    for sequence, want in ((False, token_level), (True, sequence_level)):
        fields = step_fields(token_mask, sample_mask, gbs=3, objective=objective, sequence_level=sequence,
                             groups=["p", "p", "q"])
        scale = fields[ADVANTAGE_SCALE]
        got = [float(scale[0, 2]), float(scale[0, 3]), float(scale[0, 4]), float(scale[1, 2])]
        assert got == pytest.approx(want, rel=1e-6), (mode, sequence)
        assert float(scale[:, :2].abs().sum() + scale[1, 3:].abs().sum() + scale[2].abs().sum()) == 0
        assert fields[STEP_SEQUENCES].tolist() == [2.0] * 3 and fields[STEP_TOKENS].tolist() == [4.0] * 3


def test_groups_are_prompts_and_a_group_cut_across_steps_is_refused():
    """Rows sharing the tokens before their first loss token are one group (whatever the response);
    a group over two steps, or into the remainder NeMo-RL drops, is refused naming the batch keys and
    the group by its rows."""
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 9], [5, 7, 7, 8], [5, 6, 1, 2]])
    mask = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 0], [0, 0, 1, 1], [0, 0, 1, 1]], dtype=torch.float32)
    groups = prompt_groups(ids, mask)
    assert groups[0] == groups[1] == groups[3] != groups[2]
    objective = HostObjective("prompt_mean")
    cut = r"train_global_batch_size=2 rows in order\) cut group of rows \[0, 1, 3\] \(3 rows\) over steps \[0, 1\]"
    with pytest.raises(NemoRLBatchError, match=cut):
        step_fields(mask, torch.ones(4), gbs=2, objective=objective, sequence_level=False, groups=groups)
    order = [0, 2, 1]  # a step of rows 0 and 2, row 1 (row 0's group) left over
    with pytest.raises(NemoRLBatchError, match=r"group of rows \[0, 2\] \(2 rows\) over steps \[0, 'the remainder"):
        step_fields(mask[order], torch.ones(3), gbs=2, objective=objective, sequence_level=False,
                    groups=[groups[i] for i in order])


def test_the_cut_group_message_names_rows_not_prompt_tokens():
    """Prompts of 3000 tokens (a real prompt's size), 12 groups of 3 all cut by steps of 2 rows: the
    refusal names policy.train_global_batch_size and each group by its rows, lists 5 groups and
    counts the rest, and stays short (the old message spelled out every group's token tuple: over
    100,000 characters here)."""
    prompt_len, groups_n, size = 3000, 12, 3
    rows = groups_n * size
    ids = torch.zeros(rows, prompt_len + 2, dtype=torch.long)
    mask = torch.zeros(rows, prompt_len + 2)
    for g in range(groups_n):
        ids[g * size:(g + 1) * size, :prompt_len] = torch.arange(prompt_len) * 7 + 1000 * g + 1
    mask[:, prompt_len:] = 1.0
    groups = prompt_groups(ids, mask)
    with pytest.raises(NemoRLBatchError) as refused:
        step_fields(mask, torch.ones(rows), gbs=2, objective=HostObjective("prompt_mean"), sequence_level=False,
                    groups=groups)
    message = str(refused.value)
    assert "policy.train_global_batch_size=2" in message and "group of rows [0, 1, 2] (3 rows)" in message
    assert "(and 7 more)" in message and len(message) < 1000, (len(message), message[:300])


def _multi_turn(first_masked: list):
    """Two prompts x 3 responses, each response 2 turns: generated tokens (columns 3-4), an
    environment message (column 5, neither trained nor generated), generated tokens (columns 6-7).
    ``first_masked`` rows have their first turn untrained (token_mask 0) but generated
    (generation_logprobs non-zero, as NeMo-RL gives every generated token)."""
    ids = torch.tensor([[1, 2, 3, 10 + i, 20 + i, 9, 30 + i, 40 + i] for i in range(3)]
                       + [[1, 2, 4, 10 + i, 20 + i, 9, 30 + i, 40 + i] for i in range(3)])
    generated = torch.tensor([[0, 0, 0, 1, 1, 0, 1, 1]] * 6, dtype=torch.float32)
    mask = generated.clone()
    for i in first_masked:
        mask[i, 3:5] = 0.0
    return ids, mask, generated * -0.5


def test_a_masked_first_response_token_does_not_split_a_group():
    """A multi-turn row whose first turn is untrained: its prompt ends where its generated tokens
    begin (generation_logprobs), so it stays in its prompt's group; from the token mask alone it was
    a group of its own (the old reading). Two prompts stay apart."""
    ids, mask, gen = _multi_turn(first_masked=[1, 4])
    groups = prompt_groups(ids, mask, gen)
    assert groups[0] == groups[1] == groups[2] == (1, 2, 3) and groups[3] == groups[4] == groups[5] == (1, 2, 4)
    fields = step_fields(mask, torch.ones(6), gbs=6, objective=HostObjective("prompt_mean"), sequence_level=False,
                         groups=groups)
    split = step_fields(mask, torch.ones(6), gbs=6, objective=HostObjective("prompt_mean"), sequence_level=False,
                        groups=[0, 1, 0, 2, 3, 2])
    assert not torch.equal(fields[ADVANTAGE_SCALE], split[ADVANTAGE_SCALE])  # the grouping matters here


def test_nemo_rls_prompt_index_names_the_groups_where_the_batch_carries_it():
    """A batch carrying NeMo-RL's prompt index (``idx``, with ``task_name``) is grouped by it, not by
    tokens: two data sets numbering their prompts alike stay apart; without it, the tokens."""
    from megatron_pg_agg.integrations.nemo_rl.weights import PROMPT_ID, batch_prompt_groups

    ids, mask, gen = _multi_turn(first_masked=[])
    data = {"input_ids": ids, "token_mask": mask, "generation_logprobs": gen}
    assert batch_prompt_groups(data) == prompt_groups(ids, mask, gen)
    carried = {**data, PROMPT_ID: torch.tensor([7, 7, 7, 7, 7, 7]), "task_name": ["math"] * 3 + ["code"] * 3}
    groups = batch_prompt_groups(carried)
    assert groups[0] == groups[2] != groups[3] == groups[5]
    same_tokens = {**data, PROMPT_ID: [0, 1, 0, 1, 0, 1]}  # the index, not the tokens
    groups = batch_prompt_groups(same_tokens)
    assert groups[0] == groups[2] == groups[4] != groups[1] == groups[3] == groups[5]


def test_prompts_the_tokens_cannot_tell_apart_are_refused():
    """A row whose first response tokens are neither trained nor generated (generation log-prob 0)
    reads as a longer prompt that begins with its group's: refused naming the rows and NeMo-RL's
    prompt index; so is a batch with generation log-probs on column 0 (not NeMo-RL's layout)."""
    ids, mask, gen = _multi_turn(first_masked=[1])
    gen[1, 3:5] = 0.0
    nested = r"rows \[1\] have a prompt of 6 tokens .*3-token prompt of rows \[0, 2\].*'idx'"
    with pytest.raises(NemoRLBatchError, match=nested):
        prompt_groups(ids, mask, gen)
    ids, mask, gen = _multi_turn(first_masked=[])
    gen[2, 0] = -0.1
    with pytest.raises(NemoRLBatchError, match=r"generation_logprobs is non-zero on column 0 .* rows \[2\]"):
        prompt_groups(ids, mask, gen)


def test_a_sample_mask_between_0_and_1_is_refused():
    token_mask, _ = _two_rows()
    with pytest.raises(NemoRLBatchError, match="sample_mask must hold 0 or 1"):
        step_fields(token_mask, torch.tensor([1.0, 0.5, 1.0]), gbs=3, objective=HostObjective("token_mean"),
                    sequence_level=False)


def test_the_nll_scale_is_the_steps_count_of_correct_tokens():
    """VAPO's NLL: G / C on the valid tokens of rows rewarded > 0 (C = 3 of G = 4 here), 0 elsewhere."""
    token_mask, sample_mask = _two_rows()
    fields = step_fields(token_mask, sample_mask, gbs=3, objective=HostObjective("seq_mean"), sequence_level=False,
                         rewards=torch.tensor([1.0, 0.0, 1.0]))
    assert fields[NLL_SCALE][0, 2:].tolist() == pytest.approx([4 / 3] * 3)
    assert float(fields[NLL_SCALE][1:].abs().sum()) == 0.0


@pytest.fixture(scope="module")
def nemo():
    require_nemo_rl()
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossConfig, ClippedPGLossFn
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    return SimpleNamespace(config=ClippedPGLossConfig, loss=ClippedPGLossFn, data=BatchedDataDict)


class _Policy:
    """A stand-in with NeMo-RL's ``Policy.train`` signature that records what it is handed."""

    def __init__(self):
        self.cfg = {"train_global_batch_size": 6}
        self.seen = []

    def train(self, data, loss_fn, eval_mode=False, gbs=None, mbs=None, timer=None, check_dim_skip_keys=None):
        self.seen.append((data, loss_fn, gbs))
        return {"loss": 0.0}


@pytest.mark.optional_stack
def test_use_pg_agg_swaps_the_loss_and_weights_only_its_own_batches(nemo):
    """use_pg_agg returns a picklable loss (NeMo-RL ships it to Ray workers) that keeps setup()'s
    options, and makes this policy's train add the fields over every step of gbs rows, only for the
    plug-in's loss (NeMo-RL's own loss, e.g. an SFT warm-up, passes through unchanged); a loss other
    than ClippedPGLossFn is refused."""
    from megatron_pg_agg.integrations.nemo_rl.loss import PGAggLossFn
    from megatron_pg_agg.integrations.nemo_rl.plugin import use_pg_agg

    own = nemo.loss(nemo.config(ratio_clip_c=3.0, token_level_loss=False, positive_example_nll_weight=0.2))
    policy = _Policy()
    loss = use_pg_agg(_config({"mode": "prompt_mean"}, policy={"train_global_batch_size": 6,
                                                               "megatron_cfg": {"enabled": True}},
                              grpo=SimpleNamespace(seq_logprob_error_threshold=None, num_generations_per_prompt=3)),
                      policy, own)
    assert isinstance(loss, PGAggLossFn) and loss.inner is not own and loss.inner.ratio_clip_c == 3.0
    assert loss.sequence_level and loss.nll_weight == 0.2 and own.positive_example_nll_weight == 0.2
    assert pickle.loads(pickle.dumps(loss)).settings == loss.settings
    batch = random_batch(random.Random(3), groups=4, group_size=3)
    data = nemo.data({k: v for k, v in batch.items() if k != "group_of_row"})
    policy.train(data, loss, gbs=6)
    policy.train(data, own)
    (seen, _, gbs), (untouched, _, _) = policy.seen
    assert gbs == 6 and ADVANTAGE_SCALE in seen and ADVANTAGE_SCALE not in data and untouched is data
    assert seen[ADVANTAGE_SCALE].dtype == data["advantages"].dtype
    with pytest.raises(NemoRLConfigError, match="takes the ClippedPGLossFn"):
        use_pg_agg(_config({"mode": "token_mean"}), policy, object())


@pytest.mark.optional_stack
def test_the_launcher_swaps_the_loss_in_setups_result(nemo):
    """launch/nemo_rl_grpo.py's one change: in the tuple NeMo-RL's setup() returns, the ClippedPGLossFn
    is replaced by the plug-in's loss (found by type), the rest left in place; a result without exactly
    one loss is refused. The checkout's own examples/run_grpo.py loads and exposes setup and main."""
    from nemo_rl.algorithms.grpo import MasterConfig
    from nemo_rl.models.policy.lm_policy import Policy

    from megatron_pg_agg.integrations.nemo_rl.launch import load_run_grpo, swap_loss
    from megatron_pg_agg.integrations.nemo_rl.loss import PGAggLossFn

    policy = object.__new__(Policy)
    policy.cfg = {"train_global_batch_size": 8}
    config = MasterConfig.model_construct(loss_fn=SimpleNamespace(pg_agg={"mode": "seq_mean"}),
                                          policy={"train_global_batch_size": 8, "megatron_cfg": {"enabled": True}},
                                          grpo=SimpleNamespace(seq_logprob_error_threshold=None,
                                                               num_generations_per_prompt=4), data_plane=None)
    own = nemo.loss(nemo.config())
    result = (policy, "generation", None, "cluster", "loader", "val", own, "logger", "ckpt", "state", config, {}, {})
    swapped = swap_loss(result)
    assert isinstance(swapped[6], PGAggLossFn) and swapped[:6] == result[:6] and swapped[7:] == result[7:]
    with pytest.raises(NemoRLConfigError, match="returned 2 ClippedPGLossFn"):
        swap_loss(result + (own,))
    run_grpo = load_run_grpo(require_nemo_rl())
    assert callable(run_grpo.setup) and callable(run_grpo.main)


@pytest.mark.optional_stack
@pytest.mark.parametrize("overrides, refused", [
    (["++loss_fn.pg_agg=prompt_mean"], "loss_fn.pg_agg='prompt_mean' is not a block"),
    (["++loss_fn.pg_agg.mode=prompt_mean"], "policy.megatron_cfg.enabled is false"),
    (["policy.megatron_cfg.enabled=true", "policy.dtensor_cfg.enabled=false", "policy.train_global_batch_size=24",
      "++loss_fn.pg_agg.mode=prompt_mean"],
     "policy.train_global_batch_size=24 is not a multiple of grpo.num_generations_per_prompt=16"),
])
def test_the_launcher_refuses_before_nemo_rl_starts_anything(nemo, monkeypatch, overrides, refused):
    """launch/nemo_rl_grpo.py on NeMo-RL's own examples/run_grpo.py main() with the checkout's
    grpo_math_1B.yaml and Hydra overrides: a config the plug-in refuses stops as soon as NeMo-RL has
    built its MasterConfig, naming the key, before Ray starts (the old launcher refused only after
    NeMo-RL's whole setup(): Ray, tokenizer, data, workers). A setup() reached by another way runs
    the same checks before NeMo-RL's setup is called."""
    import ray

    from megatron_pg_agg.integrations.nemo_rl.launch import checked_setup, load_run_grpo, wrap_run_grpo

    checkout = require_nemo_rl()
    run_grpo = load_run_grpo(checkout)
    own_setup = run_grpo.setup
    wrap_run_grpo(run_grpo)
    config = f"{checkout}/examples/configs/grpo_math_1B.yaml"
    monkeypatch.setattr("sys.argv", ["nemo_rl_grpo.py", "--config", config, *overrides])
    with pytest.raises(NemoRLConfigError, match=refused):
        run_grpo.main()
    assert not ray.is_initialized()
    called = []

    def setup(master_config, tokenizer, dataset, val_dataset, processor=None, policy_factory=None):
        called.append(master_config)  # NeMo-RL's signature (its setup needs Ray and GPUs)

    assert list(inspect.signature(own_setup).parameters)[:4] == ["master_config", "tokenizer", "dataset",
                                                                   "val_dataset"]
    with pytest.raises(NemoRLConfigError, match="loss_fn.pg_agg='prompt_mean' is not a block"):
        checked_setup(setup)(_config("prompt_mean"), None, None, None)
    assert called == []

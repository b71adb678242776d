"""The audit of Megatron-LM's RL loop (train_rl.py at core_v0.19, megatron-core 0.19): the command run
as a user runs it, its JSON against float64 references written here from Megatron-LM's formulas.

Catches: a stock objective that is not Megatron-LM's mean of micro-batch means (the reference sums
the first step's micro-batches itself), a DP partition that is not prepare_data_for_update's
contiguous slices (the per-token case moves only through it, and cuts groups), a plug-in line that
is not a token mean over whole-group steps, and a spread the report does not see. Skips on other
megatron-core releases (the RL loop's own), and without a checkout as the other Megatron-LM tests.

With --rl-use-sequence-packing (bins by Megatron-LM's own packer; references pack by its rule written here):
a per-token count that does not count each tokenless bin once (padding bins from distribute_packed_bins,
bins of fully masked responses), log-probs not shifted one position before their tokens in the bin (measured:
4.6e-4 relative off), a step that does not take update_microbatch_calculator's ceil(ratio x bins) bins of
each rank cycled from step to step, and a bin mean not weighed 1 / (bins per step x DP).

pretrain() (``-- pretrain_gpt.py ...``, every release 0.15-0.19): a stock objective that is not
pretrain_gpt.loss_func's mean of micro-batch means (float64 reference here, every split), a
per-token count that is not loss_func's (an all-masked micro-batch counting 1, as train_rl's does,
would move the token mean by ~7e-4 at micro-batch size 1), a plug-in line that is not the step's token
mean, a parser that is not pretrain_gpt.py's (its name in argparse's refusal of the plug-in entry's
flag), and a loop rule that does not refuse a contradiction.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megatron_pg_agg.audit.batch import BatchShape, synthetic_batch
from megatron_pg_agg.versions import in_range, installed_megatron_core_version
from tests.support.launching import ROOT

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "256",
         "--max-position-embeddings", "256", "--grpo-clamp-eps-lower", "0.2", "--grpo-clamp-eps-upper", "0.2",
         "--grpo-kl-beta", "0.01"]
EPS, BETA = 0.2, 0.01


@pytest.fixture(scope="module")
def checkout(megatron_lm_checkout):
    if not in_range(installed_megatron_core_version(), ">=0.19,<0.20"):
        pytest.skip(f"the audit of Megatron-LM's RL loop targets megatron-core 0.19; installed "
                    f"{installed_megatron_core_version()}")
    return megatron_lm_checkout


def _audit(checkout, tmp_path, name: str, flags: list, dp: int = 2) -> tuple:
    path = tmp_path / f"{name}.json"
    out = subprocess.run([sys.executable, "-m", "megatron_pg_agg.audit", "megatron-lm", "--dp", str(dp),
                          "--json", str(path), "--", "--megatron-lm", str(checkout), *MODEL, *flags],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    return out, (json.loads(path.read_text()) if out.returncode == 0 else None)


def _token_losses(batch, rows: list) -> list:
    """Megatron-LM's per-token GRPO loss (calculate_grpo_loss: PPO clip, k3 KL, no entropy) in float64."""
    out = []
    for i in rows:
        cur, old, ref = batch.logprobs[i].double(), batch.old_logprobs[i].double(), batch.ref_logprobs[i].double()
        ratio, adv = (cur - old).exp(), float(batch.advantages[i])
        pg = -torch.minimum(ratio * adv, ratio.clamp(1 - EPS, 1 + EPS) * adv)
        out.append((pg + BETA * ((ref - cur).exp() - (ref - cur) - 1)) * batch.masks[i])
    return out


@pytest.fixture(scope="module")
def mean_of_means(checkout, tmp_path_factory):
    flags = ["--micro-batch-size", "2", "--global-batch-size", "16", "--grpo-group-size", "4",
             "--grpo-prompts-per-step", "8"]
    return _audit(checkout, tmp_path_factory.mktemp("audit"), "mom", flags)


def test_the_rl_loop_without_per_token_loss_moves_and_the_plugin_does_not(mean_of_means):
    out, data = mean_of_means
    assert out.returncode == 0, out.stderr[-3000:]
    batch = synthetic_batch(BatchShape(4, 8, 128))
    # the configured split (micro-batch 2, DP 2): step 0 is rows 0-7 of rank 0 and rows 16-23 of rank 1
    means = []
    for rows in ([0, 1], [2, 3], [4, 5], [6, 7], [16, 17], [18, 19], [20, 21], [22, 23]):
        tokens = sum(int(batch.masks[i].sum()) for i in rows)
        means.append(float(sum(t.sum() for t in _token_losses(batch, rows))) / max(tokens, 1))
    want = sum(means[:4]) / 4 / 2 + sum(means[4:]) / 4 / 2
    got = data["splits"][0]["step_objectives"][0]
    assert abs(got - want) <= 1e-5 * max(abs(want), 0.01), (got, want)
    assert data["spread"] > 0.05, data["spread"]
    assert data["plugin_spread"] < 1e-6, data["plugin_spread"]
    # the plug-in: a token mean over the first 16 rows (groups 0-3), whatever the split
    rows = list(range(16))
    token_mean = float(sum(t.sum() for t in _token_losses(batch, rows))) / sum(int(batch.masks[i].sum()) for i in rows)
    for split in data["plugin_splits"]:
        assert abs(split["step_objectives"][0] - token_mean) <= 1e-9 * max(abs(token_mean), 0.01), split
    assert "a mean of micro-batch token means" in data["stock"]
    assert "--calculate-per-token-loss" in data["fix"]
    assert "megatron_pg_agg audit: megatron-lm" in out.stdout and "worst spread" in out.stdout


def test_per_token_loss_still_cuts_groups_and_moves_with_the_dp_size(checkout, tmp_path):
    """Groups of 4, --global-batch-size 6: DP 1 and DP 2 put other rows in a step, cutting groups; at one
    DP size the micro-batch size moves the objective only through the all-masked micro-batches' count."""
    flags = ["--calculate-per-token-loss", "--micro-batch-size", "1", "--global-batch-size", "6",
             "--grpo-group-size", "4", "--grpo-prompts-per-step", "3"]
    out, data = _audit(checkout, tmp_path, "ptl", flags)
    assert out.returncode == 0, out.stderr[-3000:]
    names = [s["split"] for s in data["splits"]]
    assert "micro-batch 1, DP 2" == names[0] and "micro-batch 1, DP 1" in names
    assert data["cut_groups"]["micro-batch 1, DP 1"] == ["group 1 over steps [0, 1]"]
    assert len(data["cut_groups"]["micro-batch 1, DP 2"]) == 3  # rows 0-2 and 6-8 share step 0
    dp1 = data["splits"][names.index("micro-batch 1, DP 1")]
    assert dp1["relative"] > 0.01
    # at one DP size only Megatron-LM's count of 1 for an all-masked micro-batch moves it: at micro-batch size 1
    # rows 1 and 8 (fully masked) are such micro-batches, one per step; at size 2 they share with a valid row
    batch = synthetic_batch(BatchShape(4, 3, 128))
    mbs2 = data["splits"][names.index("micro-batch 2, DP 1")]["step_objectives"]
    for s, rows in enumerate((range(0, 6), range(6, 12))):
        assert sum(1 for i in rows if not batch.masks[i].any()) == 1
        n = sum(int(batch.masks[i].sum()) for i in rows)
        want = mbs2[s] * n / (n + 1)
        assert abs(dp1["step_objectives"][s] - want) <= 1e-6 * max(abs(want), 0.01), (s, dp1, mbs2)
    assert data["plugin_spread"] < 1e-6


def test_a_flag_megatron_lm_does_not_know_is_refused_with_its_own_message(checkout, tmp_path):
    out, _ = _audit(checkout, tmp_path, "bad", ["--grpo-group-sise", "4"])
    assert out.returncode == 2 and "train_rl.py: error: unrecognized arguments: --grpo-group-sise 4" in out.stderr


def test_a_missing_checkout_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "megatron_pg_agg.audit", "megatron-lm", "--", "--megatron-lm",
                          str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 2
    assert out.stderr.strip().startswith("refusing to audit megatron-lm:") and len(out.stderr.strip().splitlines()) == 1


PRETRAIN_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "256",
                  "--max-position-embeddings", "256", "--micro-batch-size", "2", "--global-batch-size", "16"]


def _pretrain_audit(checkout, tmp_path, name: str, flags: list) -> tuple:
    path = tmp_path / f"{name}.json"
    out = subprocess.run([sys.executable, "-m", "megatron_pg_agg.audit", "megatron-lm", "--dp", "2", "--json",
                          str(path), "--", "pretrain_gpt.py", "--megatron-lm", str(checkout), *PRETRAIN_MODEL, *flags],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    return out, (json.loads(path.read_text()) if out.returncode == 0 else None)


def _surrogate_sums(batch, rows: list) -> tuple:
    """``(sum_t m_t l_t, sum_t m_t)`` of ``rows`` in float64, ``l_t = -A_i exp(logp_t - old_t)``."""
    total = sum(float((-float(batch.advantages[i]) * (batch.logprobs[i].double() - batch.old_logprobs[i].double())
                       .exp())[batch.masks[i]].sum()) for i in rows)
    return total, sum(int(batch.masks[i].sum()) for i in rows)


def test_pretrain_without_per_token_loss_is_a_mean_of_micro_batch_means(megatron_lm_checkout, tmp_path):
    out, data = _pretrain_audit(megatron_lm_checkout, tmp_path, "pt", [])
    assert out.returncode == 0, out.stderr[-3000:]
    batch = synthetic_batch(BatchShape(1, 16, 256))
    assert [s["split"] for s in data["splits"]] == [f"micro-batch {m}, DP {d}" for d in (2, 1) for m in (2, 1, 4)]
    for split in data["splits"]:
        # every micro-batch weighs 1 / (DP x micro-batches per rank): the mean over all of them, whichever rank
        m = split["settings"]["micro_batch_size"]
        means = [s / max(n, 1) for s, n in (_surrogate_sums(batch, range(a, a + m)) for a in range(0, 16, m))]
        want = sum(means) / len(means)
        assert abs(split["step_objectives"][0] - want) <= 1e-5 * max(abs(want), 0.01), (split, want)
    assert data["spread"] > 0.05, data["spread"]  # measured 0.53 (micro-batch 1 against 2)
    total, tokens = _surrogate_sums(batch, range(16))
    for split in data["plugin_splits"]:
        assert abs(split["step_objectives"][0] - total / tokens) <= 1e-9 * max(abs(total / tokens), 0.01), split
    assert data["plugin_spread"] < 1e-6, data["plugin_spread"]
    assert "a mean of micro-batch token means (pretrain_gpt.loss_func" in data["stock"]
    assert data["settings"]["loop"] == "pretrain() (pretrain_gpt.py)" and "launch/pretrain_actor.py" in data["fix"]


def test_pretrain_with_per_token_loss_is_the_step_token_mean_in_every_split(megatron_lm_checkout, tmp_path):
    out, data = _pretrain_audit(megatron_lm_checkout, tmp_path, "ptl", ["--calculate-per-token-loss"])
    assert out.returncode == 0, out.stderr[-3000:]
    batch = synthetic_batch(BatchShape(1, 16, 256))
    assert not batch.masks[1].any()  # at micro-batch size 1, row 1 is an all-masked micro-batch
    total, tokens = _surrogate_sums(batch, range(16))
    for split in data["splits"]:
        got = split["step_objectives"][0]
        assert abs(got - total / tokens) <= 1e-6 * max(abs(total / tokens), 0.01), (split, total / tokens)
    assert data["spread"] < 1e-6 and data["plugin_spread"] < 1e-6, (data["spread"], data["plugin_spread"])


def test_pretrain_refuses_a_flag_pretrain_gpt_does_not_know(megatron_lm_checkout, tmp_path):
    # the plug-in entry's flag: not Megatron-LM's own (every parser of 0.15-0.19 knows the --grpo-* ones)
    out, _ = _pretrain_audit(megatron_lm_checkout, tmp_path, "bad", ["--pg-loss-aggregation", "token_mean"])
    assert out.returncode == 2
    want = "pretrain_gpt.py: error: unrecognized arguments: --pg-loss-aggregation token_mean"
    assert want in out.stderr, out.stderr[-2000:]


def test_a_loop_that_contradicts_the_script_is_refused(tmp_path):
    out = subprocess.run([sys.executable, "-m", "megatron_pg_agg.audit", "megatron-lm", "--loop", "rl", "--",
                          "pretrain_gpt.py", "--micro-batch-size", "2"], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 2
    assert out.stderr.strip() == "refusing to audit megatron-lm: --loop rl with a pretrain_gpt.py command line"


# --rl-use-sequence-packing: Megatron-LM's own SequencePacker, distribute_packed_bins and micro-batch calculator
# build the bins; the references below pack by the rule of sequence_packing_utils.py at core_v0.19.0 written here.
PACKED = ["--rl-use-sequence-packing", "--micro-batch-size", "1", "--grpo-group-size", "4", "--grpo-prompts-per-step",
          "8"]
PROMPT = 256 // 8  # the audit's prompt: --seq-length / 8 tokens before each response


def _bins(batch, size: int, most: int = 50) -> list:
    """SequencePacker's rule: longest trajectory first (stable), each into the current bin while its tokens and
    count allow, else into a new bin."""
    lengths = [PROMPT + n for n in batch.lengths]
    bins, current, used = [], [], 0
    for i in sorted(range(batch.rows), key=lambda i: lengths[i], reverse=True):
        if current and (used + lengths[i] > size or len(current) >= most):
            bins.append(current)
            current, used = [], 0
        current.append(i)
        used += lengths[i]
    return bins + [current]


def _fifo(bins: list, dp: int) -> list:
    """distribute_packed_bins' fifo: contiguous runs, the first ``len % dp`` ranks one longer, each rank filled up
    with empty bins to ``ceil(len / dp)``."""
    per, extra, most = len(bins) // dp, len(bins) % dp, -(-len(bins) // dp)
    ranks = []
    for r in range(dp):
        start = r * (per + 1) if r < extra else r * per + extra
        mine = bins[start:start + per + (r < extra)]
        ranks.append(mine + [[]] * (most - len(mine)))
    return ranks


def _bin_sums(batch, rows: list) -> tuple:
    return float(sum(t.sum() for t in _token_losses(batch, rows))), sum(int(batch.masks[i].sum()) for i in rows)


def _split(data, name: str) -> dict:
    return next(s for s in data["splits"] if s["split"] == name)


def test_packed_per_token_loss_counts_each_tokenless_bin_once(checkout, tmp_path):
    """One step of the 32 rows: J = sum_t m_t l_t / (valid tokens + tokenless bins), the bins (padding bins and
    bins of fully masked responses only) from the packing rule; the bin size moves J only through that count."""
    out, data = _audit(checkout, tmp_path, "packed", ["--calculate-per-token-loss", "--global-batch-size", "32",
                                                       *PACKED])
    assert out.returncode == 0, out.stderr[-3000:]
    assert [s["split"] for s in data["splits"]][:4] == ["bins of 256 tokens, DP 2", "bins of 512 tokens, DP 2",
                                                        "bins of 256 tokens, DP 1", "bins of 512 tokens, DP 1"]
    assert "bins of 128 tokens, DP 2" in data["refused_splits"]  # the longest trajectory (160 tokens) fits no such bin
    batch = synthetic_batch(BatchShape(4, 8, 128))
    total, valid = _bin_sums(batch, list(range(32)))
    counts = {}
    for dp in (2, 1):
        for size in (256, 512):
            bins = [b for rank in _fifo(_bins(batch, size), dp) for b in rank]
            counts[size, dp] = sum(1 for b in bins if not any(batch.masks[i].any() for i in b))
            want = total / (valid + counts[size, dp])
            got = _split(data, f"bins of {size} tokens, DP {dp}")["step_objectives"][0]
            assert abs(got - want) <= 1e-6 * max(abs(want), 0.01), (size, dp, got, want, counts)
    assert counts[256, 1] != counts[512, 1], counts  # the bin size moves the count here: the check can see it
    assert data["plugin_spread"] < 1e-6, data["plugin_spread"]
    assert "does not build" not in data["stock"] and "SequencePacker" in data["stock"]


def test_packed_without_per_token_loss_is_a_mean_of_bin_means(checkout, tmp_path):
    """Two steps (--global-batch-size 16) at most 3 sequences a bin, fifo: step k of a rank is its bins
    [k m, (k + 1) m) with m = ceil(bins of the rank / 2), each bin's token mean weighing 1 / (m DP)."""
    flags = ["--global-batch-size", "16", "--rl-sequence-packing-max-sequences-per-bin", "3", *PACKED]
    out, data = _audit(checkout, tmp_path, "packed_mean", flags)
    assert out.returncode == 0, out.stderr[-3000:]
    batch = synthetic_batch(BatchShape(4, 8, 128))
    for dp in (2, 1):
        for size in (256, 512):
            ranks = _fifo(_bins(batch, size, most=3), dp)
            m = -(-len(ranks[0]) // 2)
            got = _split(data, f"bins of {size} tokens, DP {dp}")["step_objectives"]
            for k in range(2):
                means = [s / max(n, 1) for rank in ranks for s, n in
                         (_bin_sums(batch, rank[j % len(rank)]) for j in range(k * m, (k + 1) * m))]
                want = sum(means) / (m * dp)
                assert abs(got[k] - want) <= 1e-5 * max(abs(want), 0.01), (size, dp, k, got, want)
    assert data["spread"] > 0.01, data["spread"]
    assert data["plugin_spread"] < 1e-6, data["plugin_spread"]

"""A batch worker's threads stay flat over its runs. Runs back to back in one forked launch (the
workers tests/distributed/workers/trainer_runs.py and megatron_lm_runs.py, as the batch tests run
them) each build megatron-core's process groups anew, and on gloo every group keeps 3 threads
(``gloo_tcp_loop`` and two ``pt_gloo_runloop``) until it is destroyed and nothing holds it. A
finished run's groups must go with its model (``tests.support.batch_runs.release_run``):
megatron-core's rotary ``forward`` cache held every model, and through DDP's hooks its buckets and
groups, until ``megatron_pg_agg.megatron.parallel.release_module_caches`` emptied it; the model's
reference cycles waited for a full collection; and Megatron-LM's runs, which keep the default
group, never destroyed their model-parallel groups. Before, a rank of these TP2 layouts gained
about 50 threads per run (a worker reached 3,000-3,600 threads on megatron-core 0.19.2)."""
from __future__ import annotations

import json

from tests.support.launching import run, torchrun, worker

RUNS = 5
SLACK = 4
"""Threads a rank may gain after its first run (a later run's rendezvous store on rank 0: 1;
one leaked run of these layouts: about 50)."""
TRAINER = ["--rollouts", "synthetic", "--train-iters", "1", "--tensor-model-parallel-size", "2",
           "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
           "--ddp-bucket-size", "4000"]
MEGATRON_LM = [  # tests/distributed/test_megatron_lm.py's tiny GPT, TP2
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "256",
    "--max-position-embeddings", "256", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--make-vocab-size-divisible-by", "64",
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-masked-softmax-fusion",
    "--no-rope-fusion", "--use-cpu-initialization", "--calculate-per-token-loss", "--train-iters", "1",
    "--tensor-model-parallel-size", "2"]


def _thread_counts(tmp_path, name: str, argv) -> dict:
    """``{rank: [threads after run 1, ..., after run RUNS]}`` of one launch of worker ``name``."""
    runs = [{"name": f"run{i}", "argv": argv(i), "env": {"PG_AGG_TEST_THREADS": str(tmp_path / f"threads{i}")}}
            for i in range(RUNS)]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    rc, out, _ = run(torchrun(2, *worker(name), tmp_path / "runs.json", tmp_path / "status.json"), 600, name)
    assert rc == 0, out[-20000:]
    assert json.loads((tmp_path / "status.json").read_text()) == {r["name"]: 0 for r in runs}
    return {rank: [int((tmp_path / f"threads{i}.rank{rank}").read_text()) for i in range(RUNS)] for rank in (0, 1)}


def _assert_flat(counts: dict) -> None:
    for rank, per_run in counts.items():
        assert max(per_run) <= per_run[0] + SLACK, f"rank {rank}: threads after each run {per_run}"


def test_a_trainer_workers_threads_after_five_runs_stay_at_their_count_after_one(tmp_path):
    _assert_flat(_thread_counts(tmp_path, "trainer_runs",
                                lambda i: [*TRAINER, "--metrics-file", str(tmp_path / f"run{i}.jsonl")]))


def test_a_megatron_lm_workers_threads_after_five_runs_stay_at_their_count_after_one(tmp_path, megatron_lm_checkout):
    _assert_flat(_thread_counts(tmp_path, "megatron_lm_runs",
                                lambda i: ["--megatron-lm", str(megatron_lm_checkout), *MEGATRON_LM]))

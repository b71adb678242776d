"""Wall time of the audit command per host, imports included (issue 59: under a minute each on 2 cores).

    python benchmarks/bench_audit.py [--python-megatron-lm PY] [--python-slime PY] [--python-verl PY] [--python-areal PY]
        [--python-nemo-rl PY] [--megatron-lm PATH] [--megatron-lm-slime PATH] [--slime PATH] [--nemo-rl PATH]
        [--hosts HOST ...] [--repeat N]

Each audit runs as a user runs it, in a fresh interpreter of the host's environment (``python -m
megatron_pg_agg.audit``), on a stock config of the host's own examples (docs/audit.md shows their
output). A host that is not installed there is reported as such (exit 2, its one line).

* Megatron-LM: examples/rl/model_configs/qwen_2p5_3b.sh at its default (non-DAPO) values, the flags
  train_rl.py receives (TP 2 on 2 x 8 GPUs: DP 8), in megatron-core 0.19 with a core_v0.19 checkout.
* slime: scripts/run-qwen3-4B.sh, with the slime checkout and a Megatron-LM one of the interpreter's
  megatron-core. Where sglang does not import (no slime environment: this repository's CI), through
  tests/unit/audit/slime_stand_ins.py, the tests' stand-ins for what slime imports and the audit
  never calls.
* verl: examples/grpo_trainer/run_qwen2-7b_math_megatron.sh's loss and batch overrides.
* AReaL: examples/math/gsm8k_grpo_megatron.yaml as AReaL 1.0.4 takes it
  (tests/unit/audit/data/areal_gsm8k_grpo_megatron.yaml).
* NeMo-RL: the checkout's own stock GRPO config (the audit's default: examples/configs/grpo_math_1B.yaml
  with its Megatron policy on, where the checkout has no grpo_math_1B_megatron.yaml).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOSTS = ("megatron-lm", "slime", "verl", "areal", "nemo-rl")
SLIME_QWEN3_4B = """
# slime scripts/run-qwen3-4B.sh: the flags train.py receives that slime's and Megatron-LM's parsers read
# (sglang's --sglang-* go to sglang's own parser); MODEL_ARGS: Qwen3-4B sizes (slime balances by FLOPs: --balance-data)
--actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate
--num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728 --num-attention-heads 32 --group-query-attention
--num-query-groups 8 --kv-channels 128 --seq-length 4096 --max-position-embeddings 40960 --swiglu --vocab-size 151936
--hf-checkpoint /root/Qwen3-4B --ref-load /root/Qwen3-4B_torch_dist --load /root/Qwen3-4B_slime/
--save /root/Qwen3-4B_slime/ --save-interval 20
--prompt-data /root/dapo-math-17k/dapo-math-17k.jsonl --input-key prompt --label-key label --apply-chat-template
--rollout-shuffle --rm-type deepscaler --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8
--rollout-max-response-len 8192 --rollout-temperature 0.8 --global-batch-size 256 --balance-data
--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 --context-parallel-size 1
--expert-model-parallel-size 1 --expert-tensor-parallel-size 1 --recompute-granularity full
--recompute-method uniform --recompute-num-layers 1 --use-dynamic-batch-size --max-tokens-per-gpu 9216
--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00
--eps-clip 0.2 --eps-clip-high 0.28
--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
--rollout-num-gpus-per-engine 2 --attention-dropout 0.0 --hidden-dropout 0.0
--accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32 --attention-backend flash
"""
VERL_QWEN2_7B_MATH = [
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=1024",
    "data.max_prompt_length=1024",
    "data.max_response_length=1024",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.rollout.n=5",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
]
QWEN_2P5_3B = """
--micro-batch-size 2 --global-batch-size 512 --grpo-group-size 4 --grpo-prompts-per-step 128
--grpo-iterations 1 --grpo-clamp-eps-lower 0.2 --grpo-clamp-eps-upper 0.4 --grpo-kl-beta 0.0
--grpo-entropy-term-weight 0.0 --langrl-env-config default.yaml
--calculate-per-token-loss --seq-length 8192 --inference-max-seq-length 8192
--disable-bias-linear --add-qkv-bias --normalization RMSNorm --norm-epsilon 1e-6 --group-query-attention
--num-query-groups 2 --no-masked-softmax-fusion --attention-softmax-in-fp32 --attention-dropout 0.0
--hidden-dropout 0.0 --weight-decay 0.0 --position-embedding-type rope --rotary-percent 1.0
--rotary-base 1000000 --use-rotary-position-embeddings --swiglu --num-layers 36 --hidden-size 2048
--ffn-hidden-size 11008 --num-attention-heads 16 --max-position-embeddings 32768
--tokenizer-type HuggingFaceTokenizer --tokenizer-model unsloth/Qwen2.5-3B --lr 0.000001
--lr-warmup-samples 0 --make-vocab-size-divisible-by 64 --clip-grad 1.0 --tensor-model-parallel-size 2
--rl-use-sequence-packing --rl-sequence-packing-algo fifo
"""


def _file(folder: str, name: str, text: str) -> str:
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def _slime_module(python: str) -> str:
    has_sglang = subprocess.run([python, "-c", "import sglang"], capture_output=True).returncode == 0
    return "megatron_pg_agg.audit" if has_sglang else "tests.unit.audit.slime_stand_ins"


def _cases(args, folder: str) -> dict:
    """``{host: (interpreter, module, the audit's argv, environment)}`` of each host's stock example."""
    third_party = ROOT.parent / "shared" / "third_party"
    rl_checkout = args.megatron_lm or str(third_party / "Megatron-LM-core_v0.19.0")
    slime_env = {**os.environ, "MEGATRON_PG_AGG_SLIME": args.slime or str(third_party / "slime-624b824"),
                 "MEGATRON_LM_PATH": args.megatron_lm_slime or str(third_party / "Megatron-LM")}
    return {
        "megatron-lm": (args.python_megatron_lm, "megatron_pg_agg.audit",
                        ["megatron-lm", "--config", _file(folder, "qwen_2p5_3b.args", QWEN_2P5_3B), "--dp", "8",
                         "--", "--megatron-lm", rl_checkout], dict(os.environ)),
        "slime": (args.python_slime, _slime_module(args.python_slime),
                  ["slime", "--config", _file(folder, "qwen3_4b.args", SLIME_QWEN3_4B)], slime_env),
        "verl": (args.python_verl, "megatron_pg_agg.audit", ["verl", *VERL_QWEN2_7B_MATH], dict(os.environ)),
        "areal": (args.python_areal, "megatron_pg_agg.audit",
                  ["areal", "--config", str(ROOT / "tests" / "unit" / "audit" / "data" / "areal_gsm8k_grpo_megatron.yaml")],
                  dict(os.environ)),
        "nemo-rl": (args.python_nemo_rl, "megatron_pg_agg.audit", ["nemo-rl"],
                    {**os.environ, "MEGATRON_PG_AGG_NEMO_RL": args.nemo_rl or str(third_party / "nemo-rl-7ea279a")}),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron-lm", help="a core_v0.19 Megatron-LM checkout (default: "
                                         "../shared/third_party/Megatron-LM-core_v0.19.0)")
    p.add_argument("--megatron-lm-slime", help="the Megatron-LM checkout of slime's interpreter's megatron-core "
                                               "(default: ../shared/third_party/Megatron-LM)")
    p.add_argument("--slime", help="a slime checkout (default: ../shared/third_party/slime-624b824)")
    p.add_argument("--nemo-rl", help="a NeMo-RL checkout (default: ../shared/third_party/nemo-rl-7ea279a)")
    for host in HOSTS:
        p.add_argument(f"--python-{host}", default=sys.executable, help=f"the interpreter of {host}'s environment")
    p.add_argument("--hosts", nargs="+", choices=HOSTS, default=list(HOSTS), help="the hosts to time (default: all)")
    p.add_argument("--repeat", type=int, default=1)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for host, (python, module, argv, env) in _cases(args, folder).items():
            if host not in args.hosts:
                continue
            for _ in range(args.repeat):
                start = time.perf_counter()
                out = subprocess.run([python, "-m", module, *argv], capture_output=True, text=True, cwd=ROOT, env=env)
                seconds = time.perf_counter() - start
                tail = out.stderr.strip().splitlines()[-1:] or [""]
                status = "ok" if out.returncode == 0 else f"exit {out.returncode}: {tail[0][:300]}"
                print(f"audit {host}: {seconds:.1f} s wall ({status})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

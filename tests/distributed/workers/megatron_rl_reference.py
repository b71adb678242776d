"""Independent single-process reference for the RL entry's first step.

    python -m tests.distributed.workers.megatron_rl_reference CHECKOUT REPLAY.jsonl OUT.json -- <model flags>

Loads the runs' initial checkpoint with Megatron-LM's own ``load_checkpoint`` (the flags carry
``--load DIR --finetune``), forwards every rollout of the replay file ALONE (no planner, no
microbatches, no parallelism, no Megatron-LM RL code), and writes ``{"tokens": [[log-probs,
entropies] per rollout]}`` of the response tokens in float64. The test builds the reference record
from these with ``tests.support.reference.reference_record``.
"""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from tests.distributed.workers.megatron_lm_reference import _load_model, _per_token_terms
from tests.support.rl_replay_data import split


def main() -> None:
    checkout, replay, out_path = sys.argv[1:4]
    net, _ = _load_model(checkout, sys.argv[sys.argv.index("--") + 1:])
    rollouts = []
    for line in open(replay):
        prompt, response = split(json.loads(line))
        rollouts.append(SimpleNamespace(prompt_ids=prompt, response_ids=response))
    with open(out_path, "w") as f:
        json.dump({"tokens": _per_token_terms(net, rollouts)}, f)


if __name__ == "__main__":
    main()

"""The HF <-> megatron-core checks of one launch (2 ranks): logits, sharded round trips, and a trained export.

    torchrun --standalone --nproc_per_node 2 -m tests.distributed.workers.hf_checks SPEC.json OUT.json

SPEC.json: ``{"models": {family: folder}, "ids": [token ids], "trained": {"family": f, "argv": [trainer
flags], "iterations": k, "out": folder}}``.

For each family and layout (DP2, TP2 or EP2 for MoE, PP2) the model is built through
``HFModel.build_chunks`` as the trainer builds it, then:

- ``export``: every tensor of ``iter_hf_weights`` against the tensor of the same name in the
  folder's safetensors files (what transformers wrote): the names must be the same set, and the
  worst absolute difference is reported;
- ``logits`` (DP2: each rank holds the whole model): the megatron-core logits of ``ids`` against
  transformers' fp32 forward of the same folder.

``trained``: the trainer's own ``setup``/``train_step`` (TP2) runs k iterations, then the
megatron-core logits of ``ids`` (gathered over TP) are recorded and the model is written with
``save_hf_folder`` to ``out``: the test loads that folder in transformers and compares.
Rank 0 writes ``{"checks": {family: {layout: {...}}}, "trained": {"logits": [...], ...}}``.
"""
from __future__ import annotations

import json
import sys


def _file_tensors(folder) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for path in folder.weight_files:
        tensors.update(load_file(path))
    return tensors


def _megatron_logits(chunks, ids):
    import torch
    from megatron.core import tensor_parallel

    with torch.no_grad():
        out = chunks[0](torch.tensor([ids]), torch.arange(len(ids))[None], None)
        return tensor_parallel.gather_from_tensor_model_parallel_region(out)[0]


def main() -> None:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    import torch
    import torch.distributed as dist

    from megatron_pg_agg.integrations.bridge.hf_model import iter_hf_weights, open_hf_model
    from megatron_pg_agg.megatron.layout import ParallelSizes
    from megatron_pg_agg.megatron.model import hf_contract_settings
    from megatron_pg_agg.megatron.parallel import init_distributed, init_parallel

    init_distributed()
    rank = dist.get_rank()
    ids = spec["ids"]
    checks = {}
    for family, path in spec["models"].items():
        hf = open_hf_model(path)
        moe = hf.shape.num_experts is not None
        truth = _file_tensors(hf.folder)
        layouts = {"DP2": dict(), "EP2" if moe else "TP2": dict(ep=2) if moe else dict(tp=2), "PP2": dict(pp=2)}
        for name, sizes in layouts.items():
            tp, pp, ep = sizes.get("tp", 1), sizes.get("pp", 1), sizes.get("ep", 1)
            init_parallel(ParallelSizes(tp=tp, pp=pp), ep=ep, seed=1)
            settings = dict(hf_contract_settings(), tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            expert_model_parallel_size=ep, variable_seq_lengths=pp > 1)
            chunks = hf.build_chunks(**settings)
            exported = dict(iter_hf_weights(hf, chunks))
            result = {"names_equal": sorted(exported) == sorted(truth), "tensors": len(exported),
                      "export_max_abs": max(float((exported[k].float() - truth[k].float()).abs().max())
                                            for k in truth if k in exported)}
            if name == "DP2":
                from transformers import AutoModelForCausalLM

                reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
                with torch.no_grad():
                    expected = reference(torch.tensor([ids])).logits[0]
                result["logits_max_abs"] = float((_megatron_logits(chunks, ids) - expected).abs().max())
            checks.setdefault(family, {})[name] = result
            if rank == 0:
                print(f"[hf_checks] {family} {name}: {result}", flush=True)
    trained = {}
    if spec.get("trained"):
        trained = _trained(spec["trained"], ids)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"checks": checks, "trained": trained}, f)


def _trained(spec: dict, ids: list) -> dict:
    """The trainer's own setup and steps on the spec's flags, then the logits and the HF folder."""
    from megatron_pg_agg.integrations.bridge.hf_model import open_hf_model, save_hf_folder
    from megatron_pg_agg.training.run_config import RunConfig, parse_flags
    from megatron_pg_agg.training.trainer import setup, train_step

    cfg = RunConfig.from_args(parse_flags(spec["argv"]))
    s = setup(cfg)
    records = [train_step(s) for _ in range(spec["iterations"])]
    logits = _megatron_logits(s.model, ids)
    save_hf_folder(open_hf_model(cfg.model.hf_model), s.model, spec["out"], rank=s.rank)
    return {"logits": logits.tolist(), "objectives": [r["objective"] for r in records]}


if __name__ == "__main__":
    main()

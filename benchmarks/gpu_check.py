"""GPU check for one NVIDIA GPU (H200 class), under 5 minutes:

    python benchmarks/gpu_check.py [--json gpu_check.json] [--tokens 8000000] [--bandwidth-gbs 4800]

1. No host sync on the per-microbatch loss path: ``aggregate``, ``weighted_sum`` and the whole
   Megatron ``pg_loss_func`` (vocab log-probs, entropy, PPO, KL, report) forward and backward on
   CUDA tensors under ``torch.cuda.set_sync_debug_mode("error")``, every mode, bf16 logits.
2. bf16 losses: the token form in bf16 against the same computation in fp32; the critic's value
   term (``core.value.value_loss_sum``) with no host sync, bf16 against fp32, every mode.
3. Aggregation of T tokens (default 8M) forward+backward against a bare masked sum
   ``where(mask, loss, 0).sum() / count``: CUDA-event times, ratio, and achieved bandwidth (bytes
   the kernels must move / time) against the card's (H200: about 4.8 TB/s).
4. Transformer Engine's THD attention (``TEDotProductAttention``) against the CPU stand-in
   (``ThdDotProductAttention``) on the same packed batch; skipped, and said so, without TE.
5. With ``--megatron-lm PATH`` (a core_v0.19.x checkout): Megatron-LM's RL loop step and whole
   collection iteration times (the old and reference log-prob passes and the step), the packed
   entry against Megatron-LM's own packed (``--rl-use-sequence-packing``) and unpacked paths at
   equal tokens (:func:`rl_step_command`, ``benchmarks/bench_rl_step.py --gpu``), its
   ``rl step: ...; collection: ...`` line in the report.
Prints one JSON summary; exit status 1 if a check failed. On a machine without CUDA it says so
and exits 0 without checking anything.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

from megatron_pg_agg.core.modes import MODES


def _packed_step(tokens: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(32, 2049, (tokens // 1000 + 8,), generator=g)
    lengths = lengths[: int((lengths.cumsum(0) <= tokens).sum())]
    lengths = torch.cat([lengths, torch.tensor([tokens - int(lengths.sum())])])
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.long)
    cu[1:] = lengths.cumsum(0)
    groups = [8] * (lengths.numel() // 8) + ([lengths.numel() % 8] if lengths.numel() % 8 else [])
    den = torch.rand(tokens, generator=g) > 0.1
    num = den & (torch.rand(tokens, generator=g) > 0.05)
    loss = torch.randn(tokens, generator=g)
    return loss.to(device), num.to(device), den.to(device), cu.to(device), groups


def check_no_sync(report: dict) -> None:
    from megatron_pg_agg import aggregate, token_weights, weighted_sum
    from megatron_pg_agg.core.losses import PGLossConfig
    from megatron_pg_agg.data.planner import PlanConfig, plan_step
    from megatron_pg_agg.data.synthetic import synthetic_rollouts
    from megatron_pg_agg.megatron.loss_func import pg_loss_func

    loss, num, den, cu, groups = _packed_step(200_000, "cuda")
    rollouts = synthetic_rollouts(num_steps=1, vocab_size=128)[0]
    results = {}
    for mode in MODES:
        kw = {"divisor": 2048.0} if mode == "constant" else {}
        group_kw = {"group_sizes": torch.tensor(groups, device="cuda")} if mode == "prompt_mean" else {}
        weights = token_weights(num, mode=mode, cu_seqlens=cu, denominator_mask=den, **kw, **group_kw)
        cfg = PGLossConfig(mode=mode, kl_coef=0.01, entropy_coef=0.001, dual_clip=3.0, **kw)
        plan = plan_step(rollouts, cfg, PlanConfig(dp_size=1, num_microbatches=2))
        mb = plan.for_rank(0)[0].to("cuda")
        logits = torch.randn(1, mb.num_tokens, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        leaf = loss.detach().clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            mean, w = aggregate(leaf, num, mode=mode, cu_seqlens=cu, denominator_mask=den, **kw, **group_kw)
            mean.backward()
            s, c = weighted_sum(leaf, num, weights)
            s.backward()
            out, count, rep = pg_loss_func(mb, cfg, plan.totals, None, logits)
            out.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        results[mode] = {"ok": bool(torch.isfinite(logits.grad).all()), "count": int(count)}
    report["no_host_sync"] = results


def check_bf16(report: dict) -> None:
    from megatron_pg_agg import token_weights, weighted_sum

    loss, num, den, cu, groups = _packed_step(1_000_000, "cuda")
    out = {}
    for mode in MODES:
        kw = {"divisor": 2048.0} if mode == "constant" else {}
        if mode == "prompt_mean":
            kw["group_sizes"] = groups
        w = token_weights(num, mode=mode, cu_seqlens=cu, denominator_mask=den, **kw)
        s16, c16 = weighted_sum(loss.bfloat16(), num, w)
        s32, c32 = weighted_sum(loss.bfloat16().float(), num, w)
        out[mode] = {"rel_err": float((s16 - s32).abs() / s32.abs().clamp_min(1e-30)), "counts_equal": bool(c16 == c32)}
    report["bf16"] = out


def check_value_term(report: dict) -> None:
    """The critic's value term (``core.value.value_loss_sum``) on CUDA: forward and backward with no
    host sync (sync debug mode ``error``), clipped, every value mode; bf16 values against the same
    values in fp32."""
    from megatron_pg_agg import token_weights
    from megatron_pg_agg.core.value import ValueLossConfig, value_loss_sum

    loss, num, den, cu, groups = _packed_step(1_000_000, "cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    old = torch.randn(loss.shape, device="cuda", generator=g)
    returns = old + torch.randn(loss.shape, device="cuda", generator=g)
    out = {}
    for mode in MODES:
        kw = {"divisor": 2048.0} if mode == "constant" else {}
        group_kw = {"group_sizes": groups} if mode == "prompt_mean" else {}
        weights = token_weights(num, mode=mode, cu_seqlens=cu, denominator_mask=den, **kw, **group_kw)
        cfg = ValueLossConfig(mode, kw.get("divisor"), clip_eps=0.2)
        values32 = old + 0.3 * torch.randn(loss.shape, device="cuda", generator=g)
        values = values32.bfloat16().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            s16, c16, _ = value_loss_sum(values, old, returns, num, weights, cfg)
            s16.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        s32, c32, _ = value_loss_sum(values32, old, returns, num, weights, cfg)
        out[mode] = {"rel_err_bf16_vs_fp32": float((s16.detach() - s32).abs() / s32.abs().clamp_min(1e-30)),
                     "counts_equal": bool(c16 == c32), "grad_finite": bool(torch.isfinite(values.grad).all())}
    report["value_term"] = out


def _cuda_time(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def check_throughput(report: dict, tokens: int, bandwidth_gbs: float) -> None:
    from megatron_pg_agg import aggregate, token_weights, weighted_sum

    loss, num, den, cu, groups = _packed_step(tokens, "cuda")
    out = {}

    def bare():
        leaf = loss.detach().requires_grad_(True)
        (torch.where(num, leaf, 0.0).sum() / den.sum()).backward()

    bare_ms = _cuda_time(bare, 20)
    # bytes the bare kernels must move at least: loss (4) + mask (1) read, grad (4) written, + den (1)
    bare_bytes = tokens * 10
    out["bare"] = {"ms": bare_ms, "GBps": bare_bytes / bare_ms / 1e6}
    for mode in MODES:
        kw = {"divisor": 2048.0} if mode == "constant" else {}
        if mode == "prompt_mean":
            kw["group_sizes"] = torch.tensor(groups, device="cuda")
        w = token_weights(num, mode=mode, cu_seqlens=cu, denominator_mask=den, **kw)

        def token_form():
            leaf = loss.detach().requires_grad_(True)
            weighted_sum(leaf, num, w)[0].backward()

        def local_form():
            leaf = loss.detach().requires_grad_(True)
            aggregate(leaf, num, mode=mode, cu_seqlens=cu, denominator_mask=den, **kw)[0].backward()

        tf, lf = _cuda_time(token_form, 20), _cuda_time(local_form, 20)
        token_bytes = tokens * (4 + 1 + 4 + 4 + 4)  # loss, mask, coef, count read; grad written
        out[mode] = {"token_form_ms": tf, "local_form_ms": lf, "token_form_vs_bare": tf / bare_ms,
                     "local_form_vs_bare": lf / bare_ms, "token_form_GBps": token_bytes / tf / 1e6,
                     "token_form_share_of_peak_bandwidth": token_bytes / tf / 1e6 / bandwidth_gbs}
    report["throughput"] = {"tokens": tokens, **out}


def check_te_attention(report: dict) -> None:
    import importlib.util

    # megatron-core 0.19's extension module imports without Transformer Engine: look for TE itself
    if importlib.util.find_spec("transformer_engine") is None:
        report["te_attention"] = {"skipped": "Transformer Engine is not installed"}
        return
    try:
        from megatron.core.transformer.custom_layers.transformer_engine import TEDotProductAttention  # noqa: F401
    except Exception:
        try:
            from megatron.core.extensions.transformer_engine import TEDotProductAttention  # noqa: F401
        except Exception as err:
            report["te_attention"] = {"skipped": f"Transformer Engine not importable: {err}"}
            return
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_pg_agg.megatron.layout import ParallelSizes
    from megatron_pg_agg.megatron.parallel import init_distributed, init_parallel
    from megatron_pg_agg.megatron.thd_attention import ThdDotProductAttention
    from megatron_pg_agg.parity.models import tiny_transformer_config

    init_distributed(backend="nccl")
    init_parallel(ParallelSizes())
    config = tiny_transformer_config(hidden_size=256, num_attention_heads=4, use_cpu_initialization=False)
    lengths = [37, 128, 5, 90]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total, heads, dim = int(cu[-1]), 4, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, heads, dim, generator=g) for _ in range(3))
    te = TEDotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu.cuda(), cu_seqlens_kv=cu.cuda(),
                             cu_seqlens_q_padded=cu.cuda(), cu_seqlens_kv_padded=cu.cuda(),
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    out_te = te(q.cuda().bfloat16(), k.cuda().bfloat16(), v.cuda().bfloat16(), None,
                attn_mask_type=AttnMaskType.causal, packed_seq_params=params).float().cpu()
    cpu_params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                                 cu_seqlens_kv_padded=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    local = ThdDotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    out_cpu = local(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=cpu_params)
    err = float((out_te.reshape(out_cpu.shape) - out_cpu).abs().max() / out_cpu.abs().max())
    report["te_attention"] = {"max_rel_err_bf16_vs_fp32": err, "ok": err < 3e-2}


def rl_step_command(megatron_lm: str, gpus: int) -> list:
    """The RL step comparison on ``gpus`` GPUs (docs/performance.md): a 8-layer, 1024-hidden GPT,
    32 prompts x 8 samples per step, bf16, Transformer Engine, NCCL."""
    here = os.path.dirname(os.path.abspath(__file__))
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus),
            os.path.join(here, "bench_rl_step.py"), "--megatron-lm", megatron_lm, "--gpu", "--layers", "8",
            "--hidden", "1024", "--seq-length", "1024", "--prompts", "32", "--group-size", "8"]


def check_rl_step(report: dict, megatron_lm: str) -> None:
    import subprocess

    cmd = rl_step_command(megatron_lm, torch.cuda.device_count())
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("rl step:")]
    report["rl_step"] = {"command": " ".join(cmd), "exit": proc.returncode, "line": lines[-1] if lines else None,
                         "tail": (proc.stdout + proc.stderr)[-3000:] if proc.returncode else None}
    if proc.returncode or not lines:
        raise RuntimeError(f"bench_rl_step.py exited {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8_000_000)
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="the card's memory bandwidth, GB/s")
    parser.add_argument("--json")
    parser.add_argument("--megatron-lm", default=None, metavar="PATH",
                        help="a core_v0.19.x checkout: also run the RL step comparison (check 5)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device: nothing to check here"}))
        return 0
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    failed = []
    t0 = time.time()
    for name, fn in (("no_host_sync", check_no_sync), ("bf16", check_bf16), ("value_term", check_value_term),
                     ("throughput", lambda r: check_throughput(r, args.tokens, args.bandwidth_gbs)),
                     ("te_attention", check_te_attention),
                     *((("rl_step", lambda r: check_rl_step(r, args.megatron_lm)),) if args.megatron_lm else ())):
        try:
            fn(report)
        except Exception:
            report[name] = {"error": traceback.format_exc()}
            failed.append(name)
        print(f"[gpu_check] {name}: {'FAILED' if name in failed else 'done'} ({time.time() - t0:.0f}s)",
              file=sys.stderr, flush=True)
    report["failed"] = failed
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    sys.exit(main())

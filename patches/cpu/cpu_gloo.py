"""CPU/gloo shim: run megatron-core schedules, DDP, tensor-parallel layers and GPTModel on CPU.

WHY
    megatron-core assumes CUDA in a handful of spots that are harmless to redirect on a CPU-only
    machine: receive buffers, TP gather buffers, DDP grad buffers and the global memory buffer are
    allocated on ``torch.cuda.current_device()``; p2p communication calls
    ``torch.cuda.synchronize()``; the schedules create ``total_num_tokens`` with a literal
    ``device="cuda"``; the default causal mask is built on ``"cuda"``; the RNG tracker reads and
    writes the CUDA generator; and with PP > 1 and tied embeddings
    ``LanguageModule.setup_embeddings_and_output_layer`` calls ``Tensor.cuda()``. This shim makes
    those spots use the CPU so the real schedules and models can be tested with gloo on CPU. It
    is CPU-only: it refuses to apply when ``torch.cuda.is_available()``.

HOW (wrappers only, never a copy of an upstream function)
    * ``torch`` in the namespace of each module in :data:`TORCH_PROXY_MODULES` is replaced by a
      thin proxy (:class:`_TorchOnCpu`) that delegates every attribute to the real ``torch``
      except: ``zeros/ones/empty/full/tensor/arange`` map a CUDA ``device`` argument to CPU, and
      ``cuda`` is a proxy of ``torch.cuda`` whose ``current_device()`` returns the CPU device
      and whose ``synchronize()`` is a no-op. The upstream functions run unchanged; only the
      name ``torch`` they look up in their own module globals differs. Because
      ``get_default_causal_mask`` / ``get_sliding_window_causal_mask`` resolve ``torch`` in
      ``megatron.core.transformer.utils``, the proxy there covers them for every importer
      (``fused_softmax`` imports them by name).
    * In ``megatron.core.tensor_parallel.random`` the ``torch.cuda`` proxy also maps the CUDA
      RNG calls used by ``CudaRNGStatesTracker.add`` / ``fork`` and
      ``model_parallel_cuda_manual_seed`` (``get_rng_state``, ``manual_seed``,
      ``random.get_rng_state``) onto the CPU generator, and ``_set_cuda_rng_state`` is wrapped
      to set the CPU generator state (its upstream body queues a ``_lazy_call`` on a CUDA
      generator that does not exist). On CPU the CPU generator *is* the device generator, so the
      tracker keeps its meaning: ``fork()`` swaps in a per-TP-rank stream. Side effect,
      deliberate and documented: ``model_parallel_cuda_manual_seed(seed)`` seeds the global CPU
      generator with ``seed``, as it seeds the CUDA default generator on GPU.
    * ``LanguageModule.setup_embeddings_and_output_layer`` is wrapped to run under a
      ``TorchFunctionMode`` that turns ``Tensor.cuda()`` into identity, for the duration of
      that call only. ``Tensor.cuda`` is a method of the global Tensor class, so no module
      namespace can be patched; a torch-function mode is scoped to the call (and thread) instead
      of monkeypatching ``torch.Tensor``.
    * MoE layers (megatron-core without Transformer Engine): ``Router.gating`` moves its weight to
      ``torch.cuda.current_device()`` (the router module's ``torch`` is proxied like the others);
      the alltoall token dispatcher creates a CUDA side stream for its device-to-host copies and
      records/synchronises an event on it (its module's ``torch`` is the ``training`` proxy of
      :mod:`.cpu_torch`, whose streams here also record no-op events: CPU work is ordered, and
      its ``maybe_move_tensor_to_cpu`` returns the numpy split sizes the all-to-all needs, as
      it does for GPU tensors);
      and ``moe_utils.RouterGatingLinearFunction`` reads the module global ``te_general_gemm``,
      which megatron-core defines only when TE imports (``moe_utils`` ~22-39 vs ~1192: a
      ``NameError`` without TE). Its ``forward``/``backward`` are wrapped to run with that
      global bound to ``None`` for the duration of the call (the value upstream tests for:
      ``te_general_gemm is not None``), so the upstream torch path runs unchanged; the name is
      removed again afterwards, and left alone where TE defined it.

    No torch attribute is patched: other code (the user's, tests') still sees the real ``torch``,
    ``torch.cuda`` and ``torch.Tensor``. The one global effect is the documented seeding of the
    CPU generator by ``model_parallel_cuda_manual_seed``.

TARGETS (megatron-core >=0.15.0,<0.20; the same on every release)
    ``<module>.torch`` for every module in :data:`TORCH_PROXY_MODULES`;
    ``megatron.core.tensor_parallel.random._set_cuda_rng_state``;
    ``megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_with_interleaving``
    (a guard, see NOT COVERED);
    ``megatron.core.models.common.language_module.language_module.LanguageModule.``
    ``setup_embeddings_and_output_layer``;
    ``megatron.core.optimizer.optimizer.clip_grad_by_total_norm_fp32`` (runs under a mode in
    which ``Tensor.type()`` of a CPU float32 tensor reads ``'torch.cuda.FloatTensor'``: upstream
    asserts that string before scaling);
    ``megatron.core.transformer.moe.token_dispatcher.torch`` (training proxy, streams with events);
    ``megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu`` (split sizes as
    numpy arrays on CPU too, as on GPU);
    ``megatron.core.transformer.moe.moe_utils.RouterGatingLinearFunction.forward`` / ``.backward``.

NOT COVERED
    ``tensor_parallel.broadcast_data`` (calls ``Tensor.cuda()``; feed batches directly on CPU),
    the local-spec ``DotProductAttention`` with packed sequences (use
    ``megatron_pg_agg.megatron.thd_attention.ThdDotProductAttention``), context parallelism (needs TE),
    ``ReduceOp.AVG`` (gloo lacks it: keep ``average_in_collective=False``),
    ``batch_p2p_comm=True`` with interleaved pipelines (runs on gloo but mismatches messages:
    use ``batch_p2p_comm=False``), and ``variable_seq_lengths=True`` with the interleaved
    schedule (it deadlocks on gloo; ``schedules.forward_backward_pipelining_with_interleaving``
    is wrapped to raise a clear error instead of hanging: pad micro-batches to one length).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ...versions import SUPPORTED_MEGATRON_CORE
from .._machinery import Patch, Target
from .cpu_torch import _NoStream, _TensorCudaIsIdentity, make_torch_proxy, under_mode

NAME = "cpu_gloo"
SUPPORTED = SUPPORTED_MEGATRON_CORE

TORCH_PROXY_MODULES: tuple[str, ...] = (
    "megatron.core.utils",  # GlobalMemoryBuffer.get_tensor (attention baddbmm buffer)
    "megatron.core.parallel_state",  # synchronize around barriers
    "megatron.core.pipeline_parallel.p2p_communication",  # recv buffers, synchronize
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens device="cuda"
    "megatron.core.tensor_parallel.layers",  # SP/TP gather buffers
    "megatron.core.tensor_parallel.mappings",  # gather / reduce-scatter buffers
    "megatron.core.tensor_parallel.utils",  # gather_split_1d_tensor
    "megatron.core.tensor_parallel.random",  # RNG tracker (rng=True)
    "megatron.core.distributed.param_and_grad_buffer",  # DDP grad buffers
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.transformer.utils",  # get_default_causal_mask
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",  # softmax_offset
    "megatron.core.transformer.transformer_layer",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",  # inv_freq -> device
    "megatron.core.optimizer.optimizer",  # FP32Optimizer._scale, found_inf buffers
    "megatron.core.optimizer.clip_grads",  # grad-norm buffers
    "megatron.core.transformer.moe.router",  # Router.gating moves its weight to current_device()
    "megatron.core.transformer.multi_token_prediction",  # the MTP loss tracker's buffer
)
_MOE_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
_RNG_MODULE = "megatron.core.tensor_parallel.random"


def _make_set_rng_state(original):
    """``_set_cuda_rng_state`` -> set the CPU generator (the graph-safe path stays upstream)."""

    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        if graph_safe:
            return original(new_state, device, graph_safe)
        torch.set_rng_state(new_state)
        return None

    return _set_cuda_rng_state


class _CpuFloatTypeReadsAsCuda(TorchFunctionMode):
    """Inside this mode ``Tensor.type()`` (no argument) of a CPU float32 tensor reads
    ``'torch.cuda.FloatTensor'``: ``clip_grad_by_total_norm_fp32`` asserts that type string
    before it scales the gradients (the scaling itself runs on any device)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return "torch.cuda.FloatTensor" if name == "torch.FloatTensor" else name
        return func(*args, **(kwargs or {}))


def _make_interleaved_guard(original):
    """Refuse ``variable_seq_lengths`` in the interleaved schedule on gloo, with a clear error.

    With ``variable_seq_lengths`` every p2p call first exchanges shapes and *waits* for all of
    them (``P2PCommunicator._communicate_shapes``); the tensors follow asynchronously. In the
    interleaved schedule a rank's call can hold a shape send that the peer receives only in a
    later call (observed with PP=2, 2 virtual stages, 4 ranks: rank 2 blocked in a
    send_prev+recv_prev shape exchange whose send rank 0 receives only later, rank 0 blocked
    waiting for the tensor rank 2 sends after that exchange). On gloo that send apparently does
    not complete before the matching receive is posted, so both wait forever. (Whether NCCL
    behaves differently was not checked.) The 1F1B schedules pair their calls and ran fine with
    variable lengths. Fixed-length micro-batches avoid the shape exchange: this guard turns the
    hang into an error that says so.
    """

    def forward_backward_pipelining_with_interleaving(*args, **kwargs):
        from megatron.core.utils import get_model_config  # noqa: PLC0415  (patched modules load lazily)

        model = kwargs.get("model")
        first = model[0] if isinstance(model, (list, tuple)) else model
        if first is not None and get_model_config(first).variable_seq_lengths:
            raise RuntimeError(
                "cpu_gloo: the interleaved pipeline schedule with variable_seq_lengths=True "
                "deadlocks on gloo (a blocking shape send whose receive the peer posts only in a "
                "later p2p call). Pad every micro-batch to one length (the planner's "
                "PlanConfig(uniform_microbatch_tokens=True) or microbatch_tokens=L) and set "
                "variable_seq_lengths=False."
            )
        return original(*args, **kwargs)

    return forward_backward_pipelining_with_interleaving


class _NoEvent:
    """A CUDA event stand-in: the CPU work it marks is already done."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True


class _NoStreamWithEvents(_NoStream):
    """:class:`.cpu_torch._NoStream` that also records (no-op) events, as the alltoall token
    dispatcher does after its device-to-host copies."""

    def record_event(self, event: Any = None) -> _NoEvent:
        return _NoEvent()


def _make_dispatcher_torch(original):
    """The token dispatcher's ``torch``: the ``training`` proxy (streams are no-ops), with
    streams that record events."""
    proxy = make_torch_proxy(training=True)(original)
    proxy.cuda.Stream = lambda *a, **k: _NoStreamWithEvents()
    proxy.cuda.current_stream = lambda *a, **k: _NoStreamWithEvents()
    return proxy


def _make_move_to_cpu(original):
    """The dispatcher's ``maybe_move_tensor_to_cpu``: with ``as_numpy=True`` a tensor already on
    the CPU comes back as a numpy array too (upstream converts only the tensors it copies from
    the GPU, so on CPU the all-to-all split sizes stayed tensors, which ``all_to_all_single``
    rejects)."""

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        out = original(tensor, as_numpy=as_numpy, record_stream=record_stream)
        if as_numpy and torch.is_tensor(out) and out.device.type == "cpu":
            return out.numpy()
        return out

    return maybe_move_tensor_to_cpu


@contextlib.contextmanager
def _te_general_gemm_is_none():
    """Bind ``moe_utils.te_general_gemm`` to None for the duration of the call when megatron-core
    left it undefined (no TE); leave a TE-defined one alone."""
    namespace = vars(sys.modules[_MOE_UTILS])
    missing = "te_general_gemm" not in namespace
    if missing:
        namespace["te_general_gemm"] = None
    try:
        yield
    finally:
        if missing:
            namespace.pop("te_general_gemm", None)


def _make_gating_step(original):
    """Wrap ``RouterGatingLinearFunction.forward`` or ``.backward`` (staticmethods upstream).

    The replacement is a plain function set on the class: autograd only ever calls these through
    the class (``cls.forward(ctx, ...)``, ``_forward_cls.backward(ctx, ...)``), where a plain
    function is not bound, so it behaves as the staticmethod did (a staticmethod object cannot
    carry the machinery's ``__wrapped__``)."""
    fn = original.__func__ if isinstance(original, staticmethod) else original

    def gating_step(*args, **kwargs):
        with _te_general_gemm_is_none():
            return fn(*args, **kwargs)

    gating_step.__name__ = gating_step.__qualname__ = fn.__name__
    return gating_step


def _require_cpu_only() -> None:
    if torch.cuda.is_available():
        raise RuntimeError(
            "patch 'cpu_gloo' is a CPU-only shim (it redirects megatron-core's CUDA buffers, RNG "
            "and synchronisation to the CPU) and refuses to apply when torch.cuda.is_available(). "
            "On a GPU machine run without it: apply_megatron_patches(cpu_gloo=False)."
        )


PATCH = Patch(
    name=NAME,
    supported=SUPPORTED,
    why=__doc__,
    precondition=_require_cpu_only,
    targets=tuple(
        Target(m, "torch", make_torch_proxy(rng=(m == _RNG_MODULE))) for m in TORCH_PROXY_MODULES
    )
    + (
        Target(_RNG_MODULE, "_set_cuda_rng_state", _make_set_rng_state),
        Target(
            "megatron.core.pipeline_parallel.schedules",
            "forward_backward_pipelining_with_interleaving",
            _make_interleaved_guard,
        ),
        Target(
            "megatron.core.models.common.language_module.language_module",
            "LanguageModule.setup_embeddings_and_output_layer",
            under_mode(_TensorCudaIsIdentity),
        ),
        # optimizer.py imported the function by name: wrap the name it calls
        Target("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32",
               under_mode(_CpuFloatTypeReadsAsCuda)),
        Target(_MOE_DISPATCHER, "torch", _make_dispatcher_torch),
        Target(_MOE_DISPATCHER, "maybe_move_tensor_to_cpu", _make_move_to_cpu),
        Target(_MOE_UTILS, "RouterGatingLinearFunction.forward", _make_gating_step),
        Target(_MOE_UTILS, "RouterGatingLinearFunction.backward", _make_gating_step),
    ),
)

"""The NVIDIA backend class: device, capabilities, memory, op overrides per path, CUDA graph capture.

Imported only when the backend is selected (``ProbeResult.backend_class``); it imports Triton lazily,
inside ``op_overrides``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from deepinfer_core.backends.base import Backend, Capabilities, MemoryInfo
from deepinfer_core.ops.table import OpTable
from deepinfer_nvidia_sm100.probe import NAME, arch_path, probe

VERIFIED = {
    # What ran on real hardware, by path (docs/nvidia.md, "Hardware"). Only these names count as verified;
    # everything else is implemented but unverified on that path. sm90 (an H200): "device_graphs", decode steps
    # replayed from CUDA graphs match eager steps and the CPU path (backends/nvidia_sm100/tests/test_model_gpu.py).
    # fp16 has not run, so "dtypes" is not claimed; NCCL has not run either (one GPU).
    "sm90": frozenset({"device_graphs"}),
    "sm100": frozenset(),  # no SM100 GPU has run this code yet
}


LARGE_GPU_BYTES = 70 * 1024**3
LARGE_GPU_BATCHED_TOKENS = 16384


class NvidiaBackend(Backend):
    """CUDA device backend. ``path`` is ``"sm90"`` (Hopper) or ``"sm100"`` (Blackwell) by compute capability."""

    name = NAME
    device_type = "cuda"
    probe = staticmethod(probe)
    # SGLang's chunked-prefill size on H100 / H200, vLLM's server default: small prefill steps leave the GPU waiting
    # on the host. On a GPU of at least 70 GiB ``__init__`` raises it to vLLM's offline (``LLM`` class) default
    # there, ``LARGE_GPU_BATCHED_TOKENS``
    default_max_num_batched_tokens = 8192
    # the host reads step N's tokens while the GPU computes step N + 1
    default_async_scheduling = True
    # one host thread, as vLLM's GPU workers: the host's work is launching small ops, and with a pool of many
    # threads some processes launch them several times slower (the OpenMP threads waiting on each other)
    host_threads = 1

    def __init__(self, device_index: int | None = None) -> None:
        from deepinfer_nvidia_sm100.kernels.compiled import StepCompiler

        if not torch.cuda.is_available():
            raise RuntimeError(f"{NAME}: {probe().reason}")
        index = torch.cuda.current_device() if device_index is None else device_index
        super().__init__(index)
        self.capability = torch.cuda.get_device_capability(index)
        path = arch_path(self.capability)
        if path is None:
            major, minor = self.capability
            raise RuntimeError(f"{NAME}: compute capability {major}.{minor}: needs 9.x or 10.x")
        self.path = path
        if torch.cuda.get_device_properties(index).total_memory >= LARGE_GPU_BYTES:
            self.default_max_num_batched_tokens = LARGE_GPU_BATCHED_TOKENS
        self._graph_pool = None  # one CUDA graph memory pool shared by every capture (capture_graph)
        self._step_compiler = StepCompiler()

    def capabilities(self) -> Capabilities:
        """fp32 / bf16 / fp16, NCCL, CUDA graphs through ``capture_graph``; no fp8. Batch-invariant variants of its
        ops (``op_variants``), which the plugin ``deepinfer-batch-invariant`` installs when the mode is on."""
        return Capabilities(
            dtypes=(torch.float32, torch.bfloat16, torch.float16),
            distributed_backend="nccl",
            device_graphs=True,
            batch_invariant=True,
            fp8=False,
            verified_on_hardware=VERIFIED[self.path],
        )

    def memory_info(self) -> MemoryInfo:
        """``torch.cuda.mem_get_info`` of this backend's device."""
        free, total = torch.cuda.mem_get_info(self.device)
        return MemoryInfo(free_bytes=int(free), total_bytes=int(total))

    def op_overrides(self) -> Mapping[str, Callable]:
        """The fast ops of this path (``sm90_ops`` / ``sm100_ops``); every other op is the reference op."""
        return sm90_ops() if self.path == "sm90" else sm100_ops()

    def op_variants(self, kind: str) -> Mapping[str, Callable]:
        """``"batch_invariant"``: this backend's kernels that run with a configuration fixed by the model's shapes
        (``kernels/invariant.py``); none for other kinds."""
        if kind != "batch_invariant":
            return {}
        from deepinfer_nvidia_sm100.kernels import invariant

        return invariant.batch_invariant_ops()

    def make_op_table(self, plugin_manager: Any = None, context: Any = None) -> OpTable:
        """The base table (reference ops, these overrides, the plugins'); then, where the table's ``hc_post`` and
        ``hc_post_sum`` are this backend's, ``hc_pre_normed`` with its Sinkhorn beside the block
        (``hc.hc_pre_normed_deferred``: those two join it)."""
        from deepinfer_nvidia_sm100.kernels import hc

        table = super().make_op_table(plugin_manager, context)
        if hc.defers_weights(table):
            table.override("hc_pre_normed", hc.hc_pre_normed_deferred, self.name)
        return table

    def capture_graph(self, fn: Callable[..., Any], example_inputs: tuple[Any, ...]) -> Callable[..., Any]:
        """Capture ``fn(*example_inputs)`` in a CUDA graph; the returned callable copies its tensor arguments
        into the captured inputs, replays, and returns the captured outputs (valid until the next call).

        ``fn`` must be static in shape and free of host synchronisation for the given inputs. Every graph of
        this backend shares one memory pool (they never run at once): a graph's outputs stay valid only
        until another graph of the backend replays. With ``DEEPINFER_NVIDIA_COMPILE_STEP=1`` ``fn`` is compiled by
        TorchInductor first, unless a compile already failed (``kernels/compiled.py: StepCompiler``).
        """
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._step_compiler.capture(
            fn, lambda step: CudaGraphRunner(step, example_inputs, self.device, pool=self._graph_pool))


def sm90_ops() -> dict[str, Callable]:
    """Hopper overrides (Triton; TileLang ``sink_attention`` where TileLang is installed; verified on the H200:
    see docs/nvidia.md)."""
    from deepinfer_nvidia_sm100.kernels import tl_attention

    ops = triton_ops()
    if tl_attention.available():  # bf16 with H % 64 == 0, d = 512; other inputs run the reference op
        ops["sink_attention"] = _with_decode_attention(tl_attention.sink_attention)
    return ops


def _with_decode_attention(attention: Callable) -> Callable:
    """``attention`` for all rows, or the Triton decode kernel for decode rows and ``attention`` for the others
    (``kernels/decode_attention.py``; unless ``DEEPINFER_NVIDIA_DECODE_ATTN=0``)."""
    from deepinfer_nvidia_sm100.kernels import decode_attention

    return decode_attention.with_fallback(attention) if decode_attention.enabled() else attention


def sm100_ops() -> dict[str, Callable]:
    """Blackwell overrides: the same Triton kernels as SM90 for now (compiled by Triton for sm_100a);
    unverified on hardware. tcgen05 / TMEM kernels are future work (docs/nvidia.md)."""
    return triton_ops()


def triton_ops() -> dict[str, Callable]:
    """The overrides both paths share: Triton kernels (``moe_experts``, the MoE routing, ``hc_pre``, ``hc_post`` and
    ``hc_post_sum``, ``apply_rope`` and ``apply_rope_``, ``sink_attention`` of decode rows, ``indexer_scores``,
    ``indexer_topk``, ``indexer_topk_index`` and ``indexer_topk_index_counts`` (a radix select per query row: no sort), ``sparse_sink_attention`` and ``visible_index`` (top-k
    sparse CSA attention reading each row's listed keys in place),
    ``gather_keys``, ``compressor_entries`` and ``compressor_entries_rope``, the cache writes, ``greedy_sample``, the
    RMS norms, alone and fused into RoPE (``rms_norm_rope``) and the ``hc`` collapse (``hc_pre_normed``), the
    shared expert), the ops of quantized weights (``quantized_ops``), ``grouped_linear`` as a strided cuBLAS batched
    GEMM (``kernels/blas.py``), the small ops that
    TorchInductor compiles to Triton, and ``fork`` on a second CUDA stream (``kernels/streams.py``)."""
    from deepinfer_core.ops import reference as ref
    from deepinfer_nvidia_sm100.kernels import (
        blas,
        cache_writes,
        compiled,
        compressor,
        decode_attention,
        gemv,
        greedy,
        hc,
        indexer,
        indexer_topk,
        keys,
        moe,
        norm,
        rope,
        route,
        sparse_attention,
        streams,
    )

    ops = {**compiled.compiled_ops(), "moe_experts": moe.moe_experts, "hc_pre": hc.hc_pre, "hc_post": hc.hc_post,
           "hc_post_sum": hc.hc_post_sum, "apply_rope": rope.apply_rope, "apply_rope_": rope.apply_rope_,
           "indexer_scores": indexer.indexer_scores,
           "indexer_topk": indexer_topk.indexer_topk, "indexer_topk_index": indexer_topk.indexer_topk_index,
           "indexer_topk_index_counts": indexer_topk.indexer_topk_index_counts,
           "gather_keys": keys.gather_keys, "fork": streams.fork,
           "moe_route_topk": route.moe_route_topk, "moe_route_hash": route.moe_route_hash,
           "compressor_entries": compressor.compressor_entries, "swiglu_mlp": moe.swiglu_mlp,
           "write_rows_": cache_writes.write_rows_, "grouped_linear": blas.grouped_linear,
           "sparse_sink_attention": sparse_attention.sparse_sink_attention,
           "visible_index": sparse_attention.visible_index, **quantized_ops()}
    if decode_attention.enabled():  # decode rows; the others the reference (sm90_ops: TileLang)
        ops["sink_attention"] = decode_attention.with_fallback(ref.sink_attention)
    if greedy.enabled():  # the sampler of an all-greedy step: ~16 one-block reductions -> two launches
        ops["greedy_sample"] = greedy.greedy_sample
    if gemv.enabled():  # one-row products: faster than cuBLAS on every preset projection (kernels/gemv.py)
        ops.update(linear=gemv.linear, grouped_linear=gemv.grouped_linear)
    if norm.enabled():  # faster than the compiled reference (kernels/norm.py); traced when compiling
        ops.update(rms_norm=norm.rms_norm, unweighted_rms_norm=norm.unweighted_rms_norm,  # and the norms fused into
                   rms_norm_rope=norm.rms_norm_rope, hc_pre_normed=hc.hc_pre_normed,  # their neighbours' kernels
                   compressor_entries_rope=compressor.compressor_entries_rope)
    return ops


def quantized_ops() -> dict[str, Callable]:
    """The ops of quantized weights (docs/quantization.md), read as stored and decoded in registers: MXFP4 and fp8
    block experts (``kernels/moe_quant.py``), fp8 block linears, grouped linears and the shared expert, weight-only
    or on fp8 tensor cores by row count (``kernels/fp8_linear.py``)."""
    from deepinfer_nvidia_sm100.kernels import fp8_linear, moe_quant

    return {"moe_experts_mxfp4": moe_quant.moe_experts_mxfp4, "moe_experts_fp8_block": moe_quant.moe_experts_fp8_block,
            "linear_fp8_block": fp8_linear.linear_fp8_block,
            "grouped_linear_fp8_block": fp8_linear.grouped_linear_fp8_block,
            "swiglu_mlp_fp8_block": fp8_linear.swiglu_mlp_fp8_block}


class CudaGraphRunner:
    """A captured CUDA graph with static input buffers (see ``NvidiaBackend.capture_graph``)."""

    def __init__(self, fn: Callable[..., Any], example_inputs: tuple[Any, ...], device: torch.device,
                 warmup: int = 2, pool: Any = None) -> None:
        from deepinfer_nvidia_sm100.kernels.compiled import capturing

        self.static_inputs = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in example_inputs)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with capturing():
            with torch.cuda.stream(stream):
                for _ in range(warmup):  # compile / autotune outside the capture
                    fn(*self.static_inputs)
            torch.cuda.current_stream(device).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.static_outputs = fn(*self.static_inputs)

    def __call__(self, *args: Any) -> Any:
        for dst, src in zip(self.static_inputs, args, strict=True):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src, non_blocking=True)
        self.graph.replay()
        return self.static_outputs

"""CPU stand-ins for the torch_npu ops the Ascend 950 adapters call: the DOCUMENTED semantics, in plain torch.

CONTRACT, NOT HARDWARE: these functions restate what torch_npu's documentation says each op computes and
which inputs it accepts. The contract tests inject this module in place of torch_npu
(``NpuOps(contract_reference)``), so they check that our adapters call the documented API correctly and
that, if the device computes what its documentation says, the adapters match ``deepinfer_core.ops.reference``.
They say nothing about what an Ascend 950 actually computes.

Sources (read, not run): the torch-npu 2.13.0 wheel's docstrings (``torch_npu/_op_plugin_docs.py``) and the
Ascend/op-plugin pages ``docs/zh/custom_APIs/torch_npu/torch_npu-<op>.md``. Where a page gives an
"equivalent computation" (等价计算逻辑) the stand-in follows it. Each stand-in enforces the documented input
constraints the adapters rely on (raising ``ContractViolation``), and fills what the docs leave undefined
(e.g. rows whose mask is all ones) with hostile values, so an adapter that depended on them would fail.
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch


class ContractViolation(AssertionError):
    """An adapter called a stand-in in a way torch_npu's documentation does not allow."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ContractViolation(message)


# --------------------------------------------------------------------------------------------------- norms
def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
    """torch_npu.npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor).

    Documented: RmsNorm without the mean subtraction of LayerNorm; ``self`` fp16 / bf16 / fp32 with 2-8 dims;
    ``gamma`` of the same dtype, normally the last dim of ``self``. Outputs ``y`` and the reverse rms
    (``rstd``) kept for the backward. Computed here in fp32: ``y = x * rsqrt(mean(x^2) + eps) * gamma``.
    """
    _require(self.dtype in (torch.float16, torch.bfloat16, torch.float32), f"npu_rms_norm: dtype {self.dtype}")
    _require(2 <= self.dim() <= 8, f"npu_rms_norm: self must have 2-8 dims, got {self.dim()}")
    _require(gamma.dtype == self.dtype, f"npu_rms_norm: gamma dtype {gamma.dtype} != self dtype {self.dtype}")
    x = self.float()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
    return (x * rstd * gamma.float()).to(self.dtype), rstd


# ---------------------------------------------------------------------------------------------------- rope
def npu_rotary_mul(input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half",
                   rotate: torch.Tensor | None = None) -> torch.Tensor:
    """torch_npu.npu_rotary_mul(Tensor input, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None).

    Documented formulas (without ``rotate``):
    half:        x1, x2 = chunk(input, 2, -1); x_new = cat((-x2, x1), -1); out = r1 * input + r2 * x_new
    interleave:  x_new = stack((-input[..., 1::2], input[..., ::2]), -1) flattened; out = r1 * input + r2 * x_new
    Constraints: 4-D input, r1, r2 (fp16 / bf16 / fp32); D even and < 896; interleave mode: B * N < 1000 and,
    for BSND input, r1 / r2 of layout 1S1D; r1 / r2 values in [-1, 1].
    """
    _require(rotate is None, "npu_rotary_mul: the adapters do not pass rotate")
    _require(rotary_mode in ("half", "interleave"), f"npu_rotary_mul: rotary_mode {rotary_mode!r}")
    _require(input.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, "npu_rotary_mul: input, r1, r2 must be 4-D")
    _require(r1.shape == r2.shape, "npu_rotary_mul: r1 and r2 shapes differ")
    batch, seq, heads, dim = input.shape
    _require(dim % 2 == 0 and dim < 896, f"npu_rotary_mul: D={dim} must be even and < 896")
    if rotary_mode == "interleave":
        _require(batch * heads < 1000, "npu_rotary_mul interleave: B * N must be < 1000")
        _require(tuple(r1.shape) == (1, seq, 1, dim), f"npu_rotary_mul interleave (BSND): r1 must be 1S1D, got {tuple(r1.shape)}")
    _require(r1.dtype == input.dtype and r2.dtype == input.dtype, "npu_rotary_mul: r1 / r2 dtype != input dtype")
    _require(bool(r1.abs().max() <= 1 + 1e-3) and bool(r2.abs().max() <= 1 + 1e-3), "npu_rotary_mul: r1/r2 outside [-1, 1]")
    x = input.float()
    if rotary_mode == "half":
        x1, x2 = torch.chunk(x, 2, dim=-1)
        x_new = torch.cat((-x2, x1), dim=-1)
    else:
        x_new = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return (r1.float() * x + r2.float() * x_new).to(input.dtype)


# ----------------------------------------------------------------------------------------------- attention
def npu_fused_infer_attention_score_v2(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, atten_mask: torch.Tensor | None = None,
    learnable_sink: torch.Tensor | None = None, num_query_heads: int = 1, num_key_value_heads: int = 0,
    softmax_scale: float = 1.0, pre_tokens: int = 2147483647, next_tokens: int = 2147483647,
    input_layout: str = "BSH", sparse_mode: int = 0, inner_precise: int = 0, return_softmax_lse: bool = False,
    **unused,
):
    """torch_npu.npu_fused_infer_attention_score_v2(query, key, value, *, ...) -> (attention_out, softmax_lse).

    Documented: ``attention_out = softmax(softmax_scale * query @ key^T + atten_mask) @ value``; atten_mask is
    bool / int8 / uint8 where 1 (True) means the pair is not computed; with sparse_mode 0 / 1 its shape may be
    (B, 1, Q_S, KV_S). query fp16 / bf16; key and value the same shape; GQA needs num_query_heads divisible by
    num_key_value_heads with a ratio <= 64; N <= 256, D <= 512 (16-aligned); in BSND, the N axes must equal
    num_query_heads / num_key_value_heads. softmax_lse (return_softmax_lse=True): log(sum(exp(s - max))) + max of
    the (scaled, masked) scores, fp32, shape (B, Q_N, Q_S, 1). inner_precise 2 / 3 enable the row-invalid
    correction for rows whose mask is all ones; with Q_S == 1 only 0 / 1 are allowed. learnable_sink: TND /
    NTD_TND only, value D <= 128. Only the BSND layout the adapter uses is implemented here.

    Undefined by the docs, filled with hostile values: rows with every key masked return NaN without the
    row-invalid correction (0 with it), and their softmax_lse is +inf.
    """
    _require(input_layout == "BSND", f"stand-in implements BSND only, got {input_layout!r}")
    _require(learnable_sink is None, "learnable_sink is documented for TND / NTD_TND with value D <= 128 only")
    _require(query.dtype in (torch.float16, torch.bfloat16), f"FIA v2: query dtype {query.dtype} (fp16/bf16 only)")
    _require(key.shape == value.shape, "FIA v2: key and value shapes must be identical")
    batch, q_len, heads, dim = query.shape
    kv_heads = num_key_value_heads or num_query_heads
    _require(heads == num_query_heads, f"FIA v2 BSND: query N={heads} != num_query_heads={num_query_heads}")
    _require(key.shape[2] == kv_heads, f"FIA v2 BSND: key N={key.shape[2]} != num_key_value_heads={kv_heads}")
    _require(heads % kv_heads == 0 and heads // kv_heads <= 64, "FIA v2: num_query_heads / num_key_value_heads <= 64")
    _require(heads <= 256 and dim <= 512 and dim % 16 == 0, f"FIA v2: N={heads} <= 256, D={dim} <= 512 and 16-aligned")
    _require(query.is_contiguous() and key.is_contiguous() and value.is_contiguous(), "FIA v2: non-contiguous input")
    _require(sparse_mode in (0, 1), "stand-in implements sparse_mode 0 / 1 (explicit mask) only")
    _require(q_len > 1 or inner_precise in (0, 1), "FIA v2: with Q_S == 1 inner_precise must be 0 or 1")
    kv_len = key.shape[1]
    k = key.float().repeat_interleave(heads // kv_heads, dim=2)  # [B, KV_S, N, D]
    v = value.float().repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bqnd,bknd->bnqk", query.float(), k) * softmax_scale  # [B, N, Q_S, KV_S]
    if atten_mask is not None:
        _require(atten_mask.dtype in (torch.bool, torch.int8, torch.uint8), f"FIA v2: atten_mask dtype {atten_mask.dtype}")
        _require(tuple(atten_mask.shape) in ((batch, 1, q_len, kv_len), (1, 1, q_len, kv_len), (1, q_len, kv_len)),
                 f"FIA v2: atten_mask shape {tuple(atten_mask.shape)}")
        masked = atten_mask.bool().reshape(-1, 1, q_len, kv_len)
        scores = scores.masked_fill(masked, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # [B, N, Q_S, 1]
    empty = torch.isinf(lse) & (lse < 0)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bnqk,bknd->bqnd", probs, v)  # [B, Q_S, N, D]
    row_fill = 0.0 if inner_precise in (2, 3) else float("nan")
    out = out.masked_fill(empty.permute(0, 2, 1, 3), row_fill)
    lse = lse.masked_fill(empty, float("inf"))
    softmax_lse = lse if return_softmax_lse else torch.zeros(1)
    return out.to(query.dtype), softmax_lse


# ------------------------------------------------------------------------------------------------------ MoE
def npu_moe_gating_top_k(x: torch.Tensor, k: int, *, bias: torch.Tensor | None = None, input_ids=None, tid2eid=None,
                         k_group: int = 1, group_count: int = 1, group_select_mode: int = 0, renorm: int = 0,
                         norm_type: int = 0, out_flag: bool = False, routed_scaling_factor: float = 1.0,
                         eps: float = 1e-20):
    """torch_npu.npu_moe_gating_top_k(x, k, *, bias, ..., norm_type, out_flag, routed_scaling_factor, eps).

    Follows the op-plugin page's equivalent computation: in fp32, ``norm = softmax(x)`` (norm_type 0) or
    ``sigmoid(x)`` (1); ``idx`` = stable descending argsort of ``norm + bias`` (group-limited when
    group_count > 1), first k; ``y = norm[idx]``; sigmoid only: ``y /= sum(y) + eps``; ``y *= routed_scaling_factor``.
    Returns (y in x's dtype, idx int32, norm fp32). Constraints: x 2-D, <= 2048 experts; bias 1-D of x's
    dtype; renorm 0 only; 1 <= k <= experts. Hash mode (input_ids / tid2eid) is documented by its
    parameters only, without a formula, so it is not implemented here (the adapters do not use it).
    """
    _require(input_ids is None and tid2eid is None, "hash mode has no documented formula; adapters must not use it")
    _require(x.dim() == 2 and x.shape[-1] <= 2048, "npu_moe_gating_top_k: x must be 2-D with <= 2048 experts")
    _require(renorm == 0, "npu_moe_gating_top_k: renorm supports 0 only")
    _require(norm_type in (0, 1), f"npu_moe_gating_top_k: norm_type {norm_type}")
    _require(1 <= k <= x.shape[-1] // group_count * k_group, "npu_moe_gating_top_k: k out of range")
    if bias is not None:
        _require(bias.dim() == 1 and bias.shape[0] == x.shape[-1] and bias.dtype == x.dtype,
                 "npu_moe_gating_top_k: bias must be 1-D, one per expert, in x's dtype")
    scores = x.float().softmax(-1) if norm_type == 0 else x.float().sigmoid()
    biased = scores + bias.float() if bias is not None else scores.clone()
    if group_count > 1:
        grouped = biased.view(x.shape[0], group_count, -1)
        group_score = grouped.amax(-1) if group_select_mode == 0 else grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.argsort(-group_score, dim=-1, stable=True)[:, :k_group]
        drop = torch.ones_like(group_score, dtype=torch.bool).scatter_(1, keep, False)
        biased = grouped.masked_fill(drop[..., None], float("-inf")).view(x.shape[0], -1)
    idx = torch.argsort(-biased, dim=-1, stable=True)[:, :k]
    y = scores.gather(1, idx)
    if norm_type == 1:
        y = y / (y.sum(-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    return y.to(x.dtype), idx.to(torch.int32), scores


def npu_moe_init_routing(x: torch.Tensor, row_idx: torch.Tensor, expert_idx: torch.Tensor, active_num: int):
    """torch_npu.npu_moe_init_routing(Tensor x, Tensor row_idx, Tensor expert_idx, int active_num).

    Documented formula (and the op-plugin page's numpy equivalent, a stable argsort):
    ``expanded_expert_idx, sorted_row_idx = keyValueSort(expert_idx, row_idx)``;
    ``expanded_row_idx[sorted_row_idx[i]] = i``; ``expanded_x[i] = x[sorted_row_idx[i] % num_rows]``;
    expanded_x keeps the first ``min(num_rows, active_num) * k`` rows. x 2-D fp16 / bf16 / fp32;
    row_idx and expert_idx int32 of shape (num_rows, k).
    """
    _require(x.dim() == 2, "npu_moe_init_routing: x must be 2-D")
    _require(row_idx.dtype == torch.int32 and expert_idx.dtype == torch.int32, "npu_moe_init_routing: int32 indices")
    _require(row_idx.shape == expert_idx.shape and expert_idx.shape[0] == x.shape[0], "npu_moe_init_routing: shapes")
    num_rows, k = expert_idx.shape
    order = torch.argsort(expert_idx.reshape(-1), stable=True)
    expanded_expert_idx = expert_idx.reshape(-1)[order]
    sorted_row_idx = row_idx.reshape(-1)[order].long()
    expanded_row_idx = torch.empty(num_rows * k, dtype=torch.int32)
    expanded_row_idx[sorted_row_idx] = torch.arange(num_rows * k, dtype=torch.int32)
    active = min(num_rows, active_num) * k
    expanded_x = x[sorted_row_idx[:active] % num_rows]
    return expanded_x, expanded_row_idx, expanded_expert_idx


def npu_moe_compute_expert_tokens(sorted_expert_for_source_row: torch.Tensor, num_expert: int) -> torch.Tensor:
    """torch_npu.npu_moe_compute_expert_tokens(Tensor sorted_expert_for_source_row, int num_expert) -> Tensor.

    Documented: ``expertTokens_i = BinarySearch(sortedExpertForSourceRow, i)``, "the position of the last row
    each expert handles"; input 1-D int32, non-decreasing, values in [0, num_expert - 1]; num_expert in
    (0, 2048]; output [num_expert] int32. Read here as the exclusive end offset (the cumulative count), the
    form ``npu_grouped_matmul(group_list_type=0)`` consumes; that reading is an assumption to check on a device.
    """
    s = sorted_expert_for_source_row
    _require(s.dim() == 1 and s.dtype == torch.int32, "npu_moe_compute_expert_tokens: 1-D int32 input")
    _require(0 < num_expert <= 2048, "npu_moe_compute_expert_tokens: num_expert in (0, 2048]")
    _require(bool((s[1:] >= s[:-1]).all()), "npu_moe_compute_expert_tokens: input must be sorted")
    return torch.searchsorted(s, torch.arange(num_expert, dtype=torch.int32), right=True).to(torch.int32)


def npu_grouped_matmul(x: Sequence[torch.Tensor], weight: Sequence[torch.Tensor], *, bias=None, group_list=None,
                       split_item: int = 0, group_type: int | None = None, group_list_type: int = 0, **unused):
    """torch_npu.npu_grouped_matmul(x, weight, *, bias, ..., group_list, split_item, group_type, group_list_type).

    Documented (non-quantized): ``y_i = x_i @ weight_i (+ bias_i)``. Implemented for the case the adapters use:
    one x [M, K], one weight [E, K, N], group_list a 1-D int64 tensor, group_type 0 (group the M axis),
    split_item 2 / 3 (one output tensor): rows of group e are ``[end[e-1], end[e])`` with group_list_type 0
    (cumulative ends) or ``counts`` with 1. Returns ``[y]`` with y [M, N]. Rows past the last group are
    undefined by the docs; here they are NaN.
    """
    _require(isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple)), "npu_grouped_matmul: x, weight are lists")
    _require(len(x) == 1 and len(weight) == 1, "stand-in implements one x and one weight tensor")
    _require(bias is None, "stand-in implements bias=None only")
    _require(split_item in (2, 3) and group_type == 0, "stand-in implements split_item 2/3 with group_type 0")
    _require(isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64 and group_list.dim() == 1,
             "npu_grouped_matmul: group_list must be a 1-D int64 tensor")
    rows, w = x[0], weight[0]
    _require(rows.dim() == 2 and w.dim() == 3 and w.shape[1] == rows.shape[1], "npu_grouped_matmul: x [M,K], w [E,K,N]")
    _require(group_list.shape[0] == w.shape[0], "npu_grouped_matmul: one group_list entry per weight group")
    _require(rows.dtype == w.dtype, "npu_grouped_matmul: x and weight dtypes differ")
    counts = group_list if group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
    _require(bool((counts >= 0).all()), "npu_grouped_matmul: group_list must be non-decreasing (type 0)")
    out = torch.full((rows.shape[0], w.shape[2]), float("nan"), dtype=rows.dtype)
    start = 0
    for group, count in enumerate(counts.tolist()):
        out[start : start + count] = rows[start : start + count] @ w[group]
        start += count
    return [out]


def npu_moe_finalize_routing(expanded_permuted_rows: torch.Tensor, skip1, skip2, bias, scales: torch.Tensor,
                             expanded_src_to_dst_row: torch.Tensor, export_for_source_row: torch.Tensor,
                             drop_pad_mode: int = 0, k: int = 1) -> torch.Tensor:
    """torch_npu.npu_moe_finalize_routing(rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
    export_for_source_row, drop_pad_mode=0, k=1) -> Tensor.

    Documented formula: ``out[i, j] = skip1[i, j] + skip2[i, j] + sum_k scales[i, k] *
    (rows[expanded_src_to_dst_row[i + k * num_rows], j] + bias[export_for_source_row[i, k], j])``. rows
    (NUM_ROWS * K, H); scales (NUM_ROWS, K) in rows' dtype; expanded_src_to_dst_row 1-D int32; skip2 None
    forces skip1 None; drop_pad_mode 0.
    """
    _require(skip1 is None or skip2 is not None, "npu_moe_finalize_routing: skip2=None requires skip1=None")
    _require(drop_pad_mode == 0, "npu_moe_finalize_routing: drop_pad_mode 0 only")
    _require(scales.dtype == expanded_permuted_rows.dtype, "npu_moe_finalize_routing: scales dtype != rows dtype")
    _require(expanded_src_to_dst_row.dtype == torch.int32, "npu_moe_finalize_routing: int32 index")
    num_rows, top_k = scales.shape
    _require(expanded_permuted_rows.shape[0] == num_rows * top_k, "npu_moe_finalize_routing: rows must be NUM_ROWS*K")
    rows = expanded_permuted_rows.float()
    out = torch.zeros(num_rows, rows.shape[1])
    for slot in range(top_k):
        picked = rows[expanded_src_to_dst_row[slot * num_rows : (slot + 1) * num_rows].long()]
        if bias is not None:
            picked = picked + bias.float()[export_for_source_row[:, slot].long()]
        out += scales[:, slot].float()[:, None] * picked
    for skip in (skip1, skip2):
        if skip is not None:
            out += skip.float()
    return out.to(expanded_permuted_rows.dtype)


# ----------------------------------------------------------------------------------------- ACL graph (npu)
class _Stream:
    def wait_stream(self, other) -> None:
        del other


class _StreamContext:
    def __init__(self, stream) -> None:
        self.stream = stream

    def __enter__(self):
        return self.stream

    def __exit__(self, *exc) -> None:
        return None


class NPUGraph:
    """Stand-in of ``torch.npu.NPUGraph`` (torch-npu 2.13.0 torch_npu/npu/graphs.py): counts replays only.

    A CPU cannot capture device work; contract tests set ``on_replay`` to recompute the captured outputs.
    """

    def __init__(self) -> None:
        self.replays = 0
        self.captured = False
        self.on_replay = None

    def replay(self) -> None:
        _require(self.captured, "NPUGraph.replay before capture")
        self.replays += 1
        if self.on_replay is not None:
            self.on_replay()


class _GraphContext:
    """Stand-in of ``torch.npu.graph(npu_graph, pool=None, stream=None, auto_dispatch_capture=False, ...)``."""

    def __init__(self, npu_graph: NPUGraph, pool=None, stream=None, auto_dispatch_capture: bool = False,
                 capture_error_mode: str = "global") -> None:
        self.npu_graph = npu_graph
        self.auto_dispatch_capture = auto_dispatch_capture

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.npu_graph.captured = True


npu = types.SimpleNamespace(
    Stream=_Stream,
    current_stream=lambda: _Stream(),
    stream=_StreamContext,
    NPUGraph=NPUGraph,
    graph=_GraphContext,
    mem_get_info=lambda device=0: (48 << 30, 64 << 30),
)
"""Stand-in of the ``torch_npu.npu`` submodule: graph API and ``mem_get_info`` (made-up numbers)."""

"""DeepSeek-V4 forward pass, written once against the op table.

The model holds plain tensors named by their canonical checkpoint names (DeepSeek's own:
``layers.N.attn.wq_a.weight``, ...); routed experts are stacked per layer (``[E, I, D]``) and each
``ffn.experts.E.w1.weight`` name addresses a view into the stack, so loading copies once. A quantized weight
(``deepinfer_core.quant.tensors``) is held as stored, its ``X.scale`` beside it, and its linear runs through the
op of its format (``linear_fp8_block``, ``moe_experts_mxfp4``, ...; :func:`linear` and friends pick the op).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch

from deepinfer_core import envs
from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from deepinfer_core.models.deepseek_v4.layout import DecodeInputs, DecodeLayout, StaticShape, StepLayout
from deepinfer_core.models.deepseek_v4.sparse_attention import (
    indexed_roped_attention,
    sparse_mode,
    sparse_roped_attention,
)
from deepinfer_core.models.deepseek_v4.state import CompressorCarry, DeepseekV4State, SavedRows, carry_span
from deepinfer_core.models.interface import ModelOutput, StateBytes
from deepinfer_core.ops.table import OpTable
from deepinfer_core.quant import tensors as quant_tensors
from deepinfer_core.quant.tensors import Fp8BlockWeight, Mxfp4Weight, QuantizedTensor
from deepinfer_core.static_buffers import StaticBuffers

Weight = torch.Tensor | Fp8BlockWeight | Mxfp4Weight  # a linear weight as the model holds it

_FP32_SUFFIXES = ("norm.weight", "attn_sink", ".ape", "gate.bias")


def keeps_fp32(name: str) -> bool:
    """Parameters HF keeps in fp32 even in a bf16 model (norms, sinks, mHC, position bias, router bias)."""
    leaf = name.rsplit(".", 1)[-1]
    return name.endswith(_FP32_SUFFIXES) or leaf.startswith(("hc_attn_", "hc_ffn_", "hc_head_"))


class FusedRun(NamedTuple):
    """Adjacent weights held as one: ``weight`` (``[sum rows, cols]``) has the ``names``' row blocks in order."""

    weight: Weight
    names: list[str]
    rows: list[int]


class ParameterRegistry:
    """Canonical name -> the tensor (or stacked-expert view) a checkpoint tensor is copied into.

    ``quantized``: the checkpoint's quantized weights by canonical name (``checkpoint.CheckpointPlan.quantized``);
    each is allocated as stored (its weight under its name, its scale under ``X.scale``) and :meth:`add` returns
    its ``Fp8BlockWeight`` / ``Mxfp4Weight``."""

    def __init__(self, dtype: torch.dtype, device: torch.device,
                 quantized: Mapping[str, QuantizedTensor] | None = None):
        self.dtype = dtype
        self.device = device
        self.quantized = dict(quantized or {})
        self.slots: dict[str, torch.Tensor] = {}
        self.weights: dict[str, Fp8BlockWeight | Mxfp4Weight] = {}  # quantized names -> the model's view
        self.allocated: list[torch.Tensor] = []  # every tensor allocated (views excluded): the bytes held

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> Weight:
        """Allocate a parameter (or return its view in a fused tensor from ``add_fused``); fp32-kept names stay
        fp32 whatever the model dtype; a quantized name gets its stored weight and scale."""
        if name in self.weights:
            return self.weights[name]
        if name in self.quantized:
            return self._add_quantized([name], shape[-1:], ())[0]
        dtype = dtype or (torch.float32 if keeps_fp32(name) else self.dtype)
        if name in self.slots:
            tensor = self.slots[name]
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise ValueError(f"parameter {name!r} was allocated as {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"now asked for {tuple(shape)} {dtype}")
            return tensor
        tensor = self._zeros(shape, dtype)
        self.slots[name] = tensor
        return tensor

    def add_fused(self, rows: dict[str, int], cols: int) -> list[FusedRun]:
        """Row blocks of fused weights: projections of the same input then run as one GEMM per run, and each name
        still loads into its own block. Unquantized names fuse into one run; quantized ones fuse while their format
        agrees and every block but the run's last fills whole scale blocks (else a new run starts)."""
        runs: list[FusedRun] = []
        for name, count in rows.items():
            if runs and self._extends(runs[-1], name):
                runs[-1].names.append(name)
                runs[-1].rows.append(count)
            else:
                runs.append(FusedRun(None, [name], [count]))
        return [self._allocate_run(run, cols) for run in runs]

    def add_stacked(self, pattern: str, count: int, shape: tuple[int, ...]) -> Weight:
        """Allocate ``[count, *shape]``; ``pattern.format(i)`` names slice ``i`` (quantized: every slice alike)."""
        names = [pattern.format(i) for i in range(count)]
        if any(name in self.quantized for name in names):
            self._same_format(names)
            return self._add_quantized(names, shape[-1:], (count,))[1]
        stacked = self._zeros((count, *shape), self.dtype)
        for i, name in enumerate(names):
            self.slots[name] = stacked[i]
        return stacked

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.zeros(shape, dtype=dtype, device=self.device)
        self.allocated.append(tensor)
        return tensor

    def _extends(self, run: FusedRun, name: str) -> bool:
        first = self.quantized.get(run.names[0])
        spec = self.quantized.get(name)
        if first is None or spec is None:
            return first is None and spec is None
        return first.key() == spec.key() and sum(run.rows) % first.block[0] == 0

    def _allocate_run(self, run: FusedRun, cols: int) -> FusedRun:
        if run.names[0] in self.quantized:
            weight = self._add_quantized(run.names, (cols,), ())[1]
            return FusedRun(weight, run.names, run.rows)
        fused = self._zeros((sum(run.rows), cols), self.dtype)
        for name, block in zip(run.names, fused.split(run.rows), strict=True):
            self.slots[name] = block
        return FusedRun(fused, run.names, run.rows)

    def _add_quantized(self, names: list[str], cols: tuple[int], stack: tuple[int, ...]):
        """Allocate quantized ``names`` as one stored weight and one scale: row blocks of them (``stack`` empty) or
        slices of a stack of ``stack[0]``. Returns ``(view of names[0], view of the whole)``."""
        specs = [self.quantized[name] for name in names]
        spec = specs[0]
        if stack:
            rows = [spec.shape[0]]
        else:
            rows = [s.shape[0] for s in specs]
        whole = dataclasses.replace(spec, shape=(sum(rows), cols[0]))
        weight = self._zeros((*stack, *whole.stored_shape), whole.stored_dtype)
        scale = self._zeros((*stack, *whole.scale_shape), whole.scale_dtype)
        if stack:
            pieces = [(weight[i], scale[i]) for i in range(stack[0])]
        else:
            scale_rows = [s.scale_shape[0] for s in specs]
            pieces = list(zip(weight.split(rows), scale.split(scale_rows), strict=True))
        for name, s, (w, sc) in zip(names, specs, pieces, strict=True):
            self.slots[name] = w
            self.slots[quant_tensors.scale_name(name)] = sc
            self.weights[name] = quant_tensors.view(s, w, sc)
        return self.weights[names[0]], quant_tensors.view(spec, weight, scale)

    def _same_format(self, names: list[str]) -> None:
        specs = [self.quantized.get(name) for name in names]
        keys = {None if s is None else s.key() for s in specs}
        if len(keys) > 1:
            from deepinfer_core.checkpoint import CheckpointError

            raise CheckpointError(f"{names[0]} and the tensors stacked with it are not stored alike (some quantized, "
                                  f"some not, or different scale formats: {sorted(map(str, keys))}); write every "
                                  "routed expert of a layer in one format")


class ExpertMap:
    """Logical expert id -> physical expert slot. Identity by default (no gather).

    With one slot per expert, assign ``logical_to_physical`` a new ``[E]`` map (a new tensor: a write into the
    current one in place is not seen while it is the identity). With replicas (EPLB's redundant experts),
    ``set_replicas(log2phy [E, max_replicas], logcnt [E])``: the ``j``-th (token, slot) pair of a step routed to
    expert ``e`` (in token, then slot order) goes to replica ``(j + offset) % logcnt[e]`` (``offset``: the
    expert-parallel rank, so ranks start on different replicas): a deterministic round-robin that splits an expert's
    pairs evenly over its replicas, as the placement plan assumes."""

    def __init__(self, num_experts: int, device: torch.device):
        self._map = torch.arange(num_experts, device=device)  # [E]
        self._identity = True
        self._log2phy: torch.Tensor | None = None  # [E, max_replicas] when some expert has more than one slot
        self._logcnt: torch.Tensor | None = None  # [E]
        self._offset = 0

    @property
    def logical_to_physical(self) -> torch.Tensor:
        """Each logical expert's first physical slot ``[E]``."""
        return self._map

    @logical_to_physical.setter
    def logical_to_physical(self, mapping: torch.Tensor) -> None:
        self._map = mapping
        self._log2phy = self._logcnt = None
        self._identity = torch.equal(mapping.cpu(), torch.arange(mapping.shape[0]))

    def set_replicas(self, log2phy: torch.Tensor, logcnt: torch.Tensor, offset: int = 0) -> None:
        """Every logical expert's physical slots: ``log2phy`` ``[E, max_replicas]`` (-1 padded), ``logcnt`` ``[E]``."""
        if log2phy.dim() != 2 or logcnt.shape != log2phy.shape[:1] or int(logcnt.min()) < 1:
            raise ValueError(f"set_replicas wants log2phy [E, max_replicas] and logcnt [E] >= 1, got "
                             f"{list(log2phy.shape)} and {list(logcnt.shape)}")
        if int(logcnt.max()) == 1:
            self.logical_to_physical = log2phy[:, 0].clone()
            return
        self._map = log2phy[:, 0].clone()
        self._identity = False
        self._log2phy, self._logcnt, self._offset = log2phy, logcnt, offset

    def to_physical(self, logical_ids: torch.Tensor) -> torch.Tensor:
        """Physical slots ``[T, k]`` of the routed ``logical_ids`` ``[T, k]``."""
        if self._identity:
            return logical_ids
        if self._log2phy is None:
            return self._map[logical_ids]
        flat = logical_ids.reshape(-1).long()  # [P = T * k]
        order = torch.argsort(flat, stable=True)  # [P] grouped by expert, in (token, slot) order inside
        counts = torch.zeros_like(self._logcnt).scatter_add_(0, flat, torch.ones_like(flat))  # [E], no device sync
        first = torch.cumsum(counts, 0) - counts  # [E] where each expert's group starts in ``order``
        occurrence = torch.empty_like(flat)
        occurrence[order] = torch.arange(flat.shape[0], device=flat.device) - first[flat[order]]  # [P]
        replica = (occurrence + self._offset) % self._logcnt[flat]  # [P]
        return self._log2phy[flat, replica].view_as(logical_ids)


def linear(ops: OpTable, x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """``x @ W.T`` through the op of ``weight``'s storage: ``linear`` or ``linear_fp8_block``."""
    if isinstance(weight, Fp8BlockWeight):
        return ops.linear_fp8_block(x, weight.weight, weight.scale, weight.block)
    return ops.linear(x, weight)


def grouped_linear(ops: OpTable, x: torch.Tensor, weight: Weight, groups: int) -> torch.Tensor:
    """The block-diagonal projection through ``grouped_linear`` or ``grouped_linear_fp8_block``."""
    if isinstance(weight, Fp8BlockWeight):
        return ops.grouped_linear_fp8_block(x, weight.weight, weight.scale, weight.block, groups)
    return ops.grouped_linear(x, weight, groups)


def mlp_op(base: str, w1: Weight, w2: Weight, w3: Weight, where: str) -> tuple[str, tuple]:
    """The op (``base``, ``base + "_fp8_block"`` or ``base + "_mxfp4"``) of a SwiGLU MLP's weights, and their
    tensors as that op takes them (each weight, then its scale; the fp8 block size last)."""
    kinds = {type(w) for w in (w1, w2, w3)}
    blocks = {w.block for w in (w1, w2, w3) if isinstance(w, Fp8BlockWeight)}
    if len(kinds) > 1 or len(blocks) > 1:
        from deepinfer_core.checkpoint import CheckpointError

        raise CheckpointError(f"{where}: w1, w2 and w3 are stored in different formats; write them alike")
    if isinstance(w1, Fp8BlockWeight):
        return f"{base}_fp8_block", (w1.weight, w1.scale, w2.weight, w2.scale, w3.weight, w3.scale, w1.block)
    if isinstance(w1, Mxfp4Weight):
        return f"{base}_mxfp4", (w1.packed, w1.scale, w2.packed, w2.scale, w3.packed, w3.scale)
    return base, (w1, w2, w3)


def _compressor_input_rows(prefix: str, layer_type: str, dim: int) -> dict[str, int]:
    """A compressor's projections of the layer input (``wkv``, ``wgate``): name -> output rows."""
    width = 2 * dim if layer_type == CSA else dim
    return {f"{prefix}.wkv.weight": width, f"{prefix}.wgate.weight": width}


class Compressor:
    """Pools every ``ratio`` tokens into one entry (CSA: overlapping windows of 2 * ratio slots)."""

    def __init__(self, reg: ParameterRegistry, prefix: str, config: DeepseekV4Config, layer_type: str, dim: int):
        self.ratio = config.compress_rates[layer_type]
        self.overlap = layer_type == CSA
        self.span = carry_span(layer_type, self.ratio)
        self.dim = dim
        width = 2 * dim if self.overlap else dim
        D = config.hidden_size
        self.eps = config.rms_norm_eps
        self.wkv = reg.add(f"{prefix}.wkv.weight", (width, D))
        self.wgate = reg.add(f"{prefix}.wgate.weight", (width, D))
        self.ape = reg.add(f"{prefix}.ape", (self.ratio, width))
        self.norm = reg.add(f"{prefix}.norm.weight", (dim,))

    def step(self, ops: OpTable, raw: torch.Tensor, layout: StepLayout, store: torch.Tensor, carry: CompressorCarry,
             rope: tuple) -> None:
        """Fold this step's tokens in (``raw [T, 2 * width]``: the layer input times ``wkv``, then times ``wgate``):
        write completed entries to ``store``, update carry."""
        width = raw.shape[-1] // 2
        raw_kv, raw_gate = raw[:, :width], raw[:, width:]  # [T, width] each
        plan = layout.windows(self.ratio, self.span)
        if plan.num_windows:
            cos, sin = plan.entry_rope(ops, rope)  # [N, rope_dim // 2] each
            entries = ops.compressor_entries_rope(raw_kv, raw_gate, carry.kv, carry.gate, plan.from_new, plan.new_rows,
                                                  plan.carry_slots, plan.carry_index, plan.valid, self.ape, self.norm,
                                                  self.eps, self.ratio, self.overlap, cos, sin)  # [N, dim]
            ops.write_rows_(store, plan.write_blocks, plan.write_rows, entries)
        ops.write_rows_(carry.rows, plan.carry_write_slots, plan.carry_write_index, raw, plan.carry_write_rows)

class Indexer:
    """Lightning indexer: picks the top ``index_topk`` CSA entries for every query. While a step has at most
    ``index_topk`` entries per sequence (contexts up to ``index_topk * ratio`` tokens) every visible entry is selected,
    and the scores are not computed (``indexer_topk`` returns ``visible`` then, whatever the scores).

    Scores and selection run in query slices of at most ``DEEPINFER_INDEXER_CHUNK_ENTRIES`` (query rows x entries)
    each: a 16K-token chunk at 1M context would otherwise hold 17 GB of fp32 scores and several times that in the
    top-k's temporaries. Every op is row-wise, so the selection is the same bits whatever the slicing."""

    def __init__(self, reg: ParameterRegistry, prefix: str, config: DeepseekV4Config):
        self.heads, self.dim = config.index_n_heads, config.index_head_dim
        self.topk = config.index_topk
        self.chunk_entries = envs.DEEPINFER_INDEXER_CHUNK_ENTRIES
        self.wq_b = reg.add(f"{prefix}.wq_b.weight", (self.heads * self.dim, config.q_lora_rank))
        self.weights_proj = reg.add(f"{prefix}.weights_proj.weight", (self.heads, config.hidden_size))
        self.compressor = Compressor(reg, f"{prefix}.compressor", config, CSA, self.dim)

    def selects(self, layout: StepLayout) -> bool:
        """Whether the indexer scores and selects this step: its sequences have more entries than its top-k."""
        return layout.entries(self.compressor.ratio).blocks.shape[1] > self.topk

    def select(self, ops: OpTable, inputs: dict[str, torch.Tensor], q_residual, layout: StepLayout, keys_store,
               query_rope, folding, as_index: bool = False):
        """Bool ``[S, Lq, E]``: which compressed entries each query attends to (``inputs``: the layer input's
        projections by role, ``Attention.project``; ``folding``: the fork folding this step's keys into
        ``keys_store``, joined before the scores read it). ``as_index``: where the indexer scores, the selection as
        entry indices ``[S, Lq, topk]`` int32 instead (``indexer_topk_index_counts`` of the layout's per-row visible
        counts ``[S, Lq]``: ascending, -1 for none; no ``[S, Lq, E]`` mask)."""
        ratio = self.compressor.ratio
        entries = layout.entries(ratio)
        if not self.selects(layout):  # the budget covers every entry: top-k selects all visible ones, unscored
            return entries.visible  # [S, Lq, E]
        visible = entries.counts if as_index else entries.visible  # [S, Lq] or [S, Lq, E]
        folding.join()
        keys = layout.gather_entries(ops, keys_store, ratio)  # [S, E, di]
        q = linear(ops, q_residual, self.wq_b).view(-1, self.heads, self.dim)  # [T, Hi, di]
        q = ops.apply_rope_(q, *query_rope)
        head_weights = inputs["index_weights"].float() * self.heads**-0.5  # [T, Hi]
        q, head_weights = layout.pad(q), layout.pad(head_weights)  # [S, Lq, Hi, di], [S, Lq, Hi]
        (S, E), Lq = entries.blocks.shape, visible.shape[1]
        rows = query_slice_rows(S, Lq, E, self.chunk_entries)
        topk = ops.indexer_topk_index_counts if as_index else ops.indexer_topk
        if rows >= Lq:
            return topk(ops.indexer_scores(q, keys, head_weights, self.dim**-0.5), visible, self.topk)
        selected = (visible.new_empty((S, Lq, self.topk), dtype=torch.int32) if as_index
                    else torch.empty_like(visible))  # [S, Lq, topk] or [S, Lq, E]
        for start in range(0, Lq, rows):
            part = slice(start, start + rows)
            scores = ops.indexer_scores(q[:, part], keys, head_weights[:, part], self.dim**-0.5)  # [S, rows, E]
            selected[:, part] = topk(scores, visible[:, part], self.topk)
        return selected


def query_slice_rows(num_seqs: int, query_len: int, num_entries: int, budget: int) -> int:
    """Query rows per indexer slice: as many as keep ``num_seqs * rows * num_entries`` within ``budget`` (at least
    one row, at most ``query_len``)."""
    return max(1, min(query_len, budget // max(1, num_seqs * num_entries)))


class Attention:
    """Shared-KV MQA with sinks over the sliding window plus (CSA / HCA) compressed entries."""

    def __init__(self, reg: ParameterRegistry, prefix: str, config: DeepseekV4Config, layer_idx: int):
        c = config
        self.layer_idx = layer_idx
        self.layer_type = c.layer_types[layer_idx]
        self.rope_type = "main" if self.layer_type == SLIDING else "compress"
        self.heads, self.head_dim, self.groups = c.num_attention_heads, c.head_dim, c.o_groups
        self.eps = c.rms_norm_eps
        rows = self._input_rows(prefix, c)
        self.input_roles = [role for role, _ in rows]
        role_of = {name: role for role, (name, _) in rows}
        self.input_runs = reg.add_fused(dict(name_rows for _, name_rows in rows), c.hidden_size)  # [rows, D] each
        self.run_roles = [[role_of[name] for name in run.names] for run in self.input_runs]
        self.compressor_columns = self._compressor_columns()
        self.wq_a = reg.add(f"{prefix}.wq_a.weight", (c.q_lora_rank, c.hidden_size))
        self.q_norm = reg.add(f"{prefix}.q_norm.weight", (c.q_lora_rank,))
        self.wq_b = reg.add(f"{prefix}.wq_b.weight", (self.heads * self.head_dim, c.q_lora_rank))
        self.wkv = reg.add(f"{prefix}.wkv.weight", (self.head_dim, c.hidden_size))
        self.norm = reg.add(f"{prefix}.norm.weight", (self.head_dim,))
        group_in = self.heads * self.head_dim // self.groups
        self.wo_a = reg.add(f"{prefix}.wo_a.weight", (self.groups * c.o_lora_rank, group_in))
        self.wo_b = reg.add(f"{prefix}.wo_b.weight", (c.hidden_size, self.groups * c.o_lora_rank))
        self.sinks = reg.add(f"{prefix}.attn_sink", (self.heads,))
        self.compressor = None
        self.indexer = None
        self.sparse = sparse_mode()  # sparse_attention.py where the indexer selects: dense, index or gather
        if self.layer_type != SLIDING:
            self.compressor = Compressor(reg, f"{prefix}.compressor", c, self.layer_type, self.head_dim)
        if self.layer_type == CSA:
            self.indexer = Indexer(reg, f"{prefix}.indexer", c)

    def _input_rows(self, prefix: str, c: DeepseekV4Config) -> list[tuple[str, tuple[str, int]]]:
        """Every projection of the layer input ``x``, as (role, (weight name, output rows)), in fused order."""
        rows = [("q", (f"{prefix}.wq_a.weight", c.q_lora_rank)), ("kv", (f"{prefix}.wkv.weight", c.head_dim))]
        if self.layer_type != SLIDING:
            compressor = _compressor_input_rows(f"{prefix}.compressor", self.layer_type, c.head_dim)
            rows += zip(("compress_kv", "compress_gate"), compressor.items(), strict=True)
        if self.layer_type == CSA:
            index = _compressor_input_rows(f"{prefix}.indexer.compressor", CSA, c.index_head_dim)
            rows += zip(("index_kv", "index_gate"), index.items(), strict=True)
            # last: its few rows (V4-Flash's 64) fill no whole scale block, so a quantized run ends after them
            rows.append(("index_weights", (f"{prefix}.indexer.weights_proj.weight", c.index_n_heads)))
        return rows

    def _compressor_columns(self) -> dict[str, tuple[int, int, int] | None]:
        """Per compressor (``compress``, ``index``): (run, first column, width) of its kv then gate columns where one
        fused run holds both (adjacent: ``_input_rows``), else None (their outputs are joined)."""
        columns = {}
        for name in ("compress", "index"):
            kv, gate = f"{name}_kv", f"{name}_gate"
            for run, roles in enumerate(self.run_roles):
                if kv not in roles:
                    continue
                if gate not in roles:
                    columns[name] = None
                    break
                starts = list(itertools.accumulate([0, *self.input_runs[run].rows]))
                first, last = roles.index(kv), roles.index(gate)
                columns[name] = (run, starts[first], starts[last + 1] - starts[first])
        return columns

    def project(self, ops: OpTable, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every projection of ``x [T, D]``, one GEMM per fused run (one run unless quantized): role -> ``[T, rows]``;
        and per compressor (``compress``, ``index``) its kv and gate columns side by side, ``[T, 2 * width]``."""
        outputs = [linear(ops, x, run.weight) for run in self.input_runs]  # [T, run rows] in column blocks
        roles = {}
        for run, out, names in zip(self.input_runs, outputs, self.run_roles, strict=True):
            roles.update(zip(names, out.split(run.rows, dim=-1), strict=True))
        for name, place in self.compressor_columns.items():
            if place is None:
                roles[name] = torch.cat([roles[f"{name}_kv"], roles[f"{name}_gate"]], dim=-1)
            else:
                run, start, width = place
                roles[name] = outputs[run].narrow(-1, start, width)
        return roles

    def __call__(self, ops: OpTable, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        T = x.shape[0]
        inputs = self.project(ops, x)
        # the key path (this step's key, the compressed stores, the keys gathered) beside the query's (a backend may
        # overlap them); the indexer's store after it, needed before the attention only where the indexer scores
        keys = ops.fork(self._keys, ops, inputs, ctx)
        index_fold = ops.fork(self._fold_index, ops, inputs, ctx) if self.indexer is not None else None
        q_residual = ops.rms_norm(inputs["q"], self.q_norm, self.eps)  # [T, q_lora]
        q = linear(ops, q_residual, self.wq_b).view(T, self.heads, self.head_dim)  # [T, H, hd], normed in attention
        keys = keys.join()  # [S, Lk (+ E), hd]
        layout = ctx.layout
        visible = layout.sliding_visible  # [S, Lq, Lk]
        cos, sin = (layout.pad(t) for t in ctx.rope[self.rope_type])  # [S, Lq, rope_dim // 2] each
        selected = None
        if self.compressor is not None:
            entry_visible = self._entry_visible(ops, inputs, q_residual, ctx, index_fold)  # [S, Lq, E] or index
            if self.sparse != "dense" and self.indexer is not None and self.indexer.selects(layout):
                selected = entry_visible  # the indexer chose: attend to the chosen entries only
            else:
                visible = layout.attention_visible(self.compressor.ratio, entry_visible)  # [S, Lq, Lk + E]
        if selected is not None and self.entries_in_place(layout):  # keys [S, Lk, hd]: the entries stay in store
            entries = layout.entries(self.compressor.ratio)
            out = indexed_roped_attention(ops, layout.pad(q), keys, visible, selected, layout.window, self.sinks,
                                          self.head_dim**-0.5, self.eps, cos, sin,
                                          (ctx.state.compressed[self.layer_idx], entries.blocks, entries.rows))
        elif selected is not None:
            out = sparse_roped_attention(ops, layout.pad(q), keys, visible, selected, layout.window, self.indexer.topk,
                                         self.sinks, self.head_dim**-0.5, self.eps, cos, sin)  # [S, Lq, H, hd]
        else:
            out = ops.roped_sink_attention(layout.pad(q), keys, visible, self.sinks, self.head_dim**-0.5, self.eps,
                                           cos, sin)  # [S, Lq, H, hd]
        grouped = grouped_linear(ops, layout.unpad(out).reshape(T, self.groups, -1), self.wo_a, self.groups)
        out = linear(ops, grouped.flatten(1), self.wo_b)  # [T, D]
        if index_fold is not None:
            index_fold.join()
        return out

    def _keys(self, ops: OpTable, inputs: dict[str, torch.Tensor], ctx: StepContext) -> torch.Tensor:
        """This step's key normed and RoPE'd, the compressed store folded (``Compressor.step``), the attention's keys
        gathered (``[S, Lk (+ E), hd]``), then the key kept in the sliding ring."""
        layout, state = ctx.layout, ctx.state
        ring = state.swa[self.layer_idx]
        kv = ops.rms_norm_rope(inputs["kv"], self.norm, self.eps, *ctx.rope[self.rope_type])  # [T, hd]
        if self.compressor is None:
            keys = layout.attention_keys(ops, ring, kv)  # [S, Lk, hd]
        else:
            store = state.compressed[self.layer_idx]
            self.compressor.step(ops, inputs["compress"], layout, store, state.carry[self.layer_idx],
                                 ctx.rope_args["compress"])
            if self.entries_in_place(layout):  # the attention reads the selected entries from the store
                keys = layout.attention_keys(ops, ring, kv)  # [S, Lk, hd]
            else:
                keys = layout.attention_keys(ops, ring, kv, store, self.compressor.ratio)  # [S, Lk + E, hd]
        layout.write_ring(ops, ring, kv)
        return keys

    def entries_in_place(self, layout: StepLayout) -> bool:
        """Whether this step's attention reads the compressed entries from the store by index (``sparse_mode``
        ``index`` on a CSA layer whose indexer selects: more entries than its top-k), so no keys gather them."""
        return self.sparse == "index" and self.indexer is not None and self.indexer.selects(layout)

    def _fold_index(self, ops: OpTable, inputs: dict[str, torch.Tensor], ctx: StepContext) -> None:
        """Fold this step's tokens into the indexer's key store (CSA layers)."""
        layer, state = self.layer_idx, ctx.state
        self.indexer.compressor.step(ops, inputs["index"], ctx.layout, state.index_keys[layer],
                                     state.index_carry[layer], ctx.rope_args["compress"])

    def _entry_visible(self, ops, inputs, q_residual, ctx: StepContext, index_fold) -> torch.Tensor:
        """Which compressed entries each query reads (``[S, Lq, E]``; where the attention reads the entries in place,
        ``entries_in_place``, the indexer's selection as indices ``[S, Lq, topk]``); the indexer's store is joined
        (``index_fold``) where the indexer scores."""
        if self.indexer is None:
            return ctx.layout.entries(self.compressor.ratio).visible
        return self.indexer.select(ops, inputs, q_residual, ctx.layout, ctx.state.index_keys[self.layer_idx],
                                   ctx.rope["compress"], index_fold, self.entries_in_place(ctx.layout))


class MoE:
    """Routed experts (top-k or hash routing) plus one shared expert, SwiGLU with clamp."""

    def __init__(self, reg: ParameterRegistry, prefix: str, config: DeepseekV4Config, layer_idx: int):
        c = config
        E, I, D = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
        self.is_hash = c.mlp_layer_types[layer_idx] == "hash_moe"
        self.top_k, self.scaling, self.limit = c.num_experts_per_tok, c.routed_scaling_factor, c.swiglu_limit
        self.scoring = c.scoring_func
        self.gate = reg.add(f"{prefix}.gate.weight", (E, D))
        if self.is_hash:
            self.tid2eid = reg.add(f"{prefix}.gate.tid2eid", (c.vocab_size, self.top_k), dtype=torch.long)
        else:
            self.bias = reg.add(f"{prefix}.gate.bias", (E,))
        self.w1 = reg.add_stacked(prefix + ".experts.{}.w1.weight", E, (I, D))
        self.w2 = reg.add_stacked(prefix + ".experts.{}.w2.weight", E, (D, I))
        self.w3 = reg.add_stacked(prefix + ".experts.{}.w3.weight", E, (I, D))
        shared = {w: f"{prefix}.shared_experts.{w}.weight" for w in ("w1", "w2", "w3")}
        reg.add_fused({shared["w1"]: I, shared["w3"]: I}, D)  # adjacent: a backend may read both in one GEMM
        self.shared = [reg.add(shared[w], shape) for w, shape in (("w1", (I, D)), ("w2", (D, I)), ("w3", (I, D)))]
        self.shared_op, self.shared_weights = mlp_op("swiglu_mlp", *self.shared, f"{prefix}.shared_experts")
        self.experts_op, self.expert_weights = mlp_op("moe_experts", self.w1, self.w2, self.w3, f"{prefix}.experts")
        self.expert_map = ExpertMap(E, reg.device)
        self.record_load = False
        self.expert_load = torch.zeros(E, dtype=torch.long, device=reg.device)  # tokens per logical expert

    def __call__(self, ops: OpTable, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts' and the shared expert's outputs ``[T, D]`` (the block output is their sum)."""
        router_logits = linear(ops, x, self.gate)  # [T, E]; first: the routing's short chain leads to the experts
        # beside the routing (a backend may overlap)
        shared = ops.fork(getattr(ops, self.shared_op), x, *self.shared_weights, self.limit)
        if self.is_hash:
            weights, ids = ops.moe_route_hash(router_logits, token_ids, self.tid2eid, self.scaling, self.scoring)
        else:
            weights, ids = ops.moe_route_topk(router_logits, self.bias, self.top_k, self.scaling, self.scoring)
        if self.record_load:
            flat = ids.reshape(-1).long()  # a fixed-size scatter: no device sync, unlike bincount
            self.expert_load.scatter_add_(0, flat, torch.ones_like(flat, dtype=self.expert_load.dtype))
        physical = self.expert_map.to_physical(ids)  # [T, k]
        routed = getattr(ops, self.experts_op)(x, physical, weights, *self.expert_weights, self.limit)
        return routed, shared.join()


@dataclasses.dataclass(frozen=True)
class HeldBytes:
    """Weight bytes a model holds, by dtype (``float8_e4m3fn``: fp8 weights, ``uint8``: packed fp4 experts,
    ``float8_e8m0fnu``: ue8m0 scales)."""

    by_dtype: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.by_dtype.values())

    def describe(self) -> str:
        """``"weights held: 8.05 GB (float8_e4m3fn 5.2 GB, uint8 2.6 GB, ...)"``, largest first."""
        parts = ", ".join(f"{dtype} {_size(n)}" for dtype, n in sorted(self.by_dtype.items(), key=lambda kv: -kv[1]))
        return f"weights held: {_size(self.total)} ({parts})"


def _size(nbytes: int) -> str:
    """``1234567`` -> ``"1.23 MB"`` (decimal units)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


class DecoderLayer:
    """mHC around attention, then mHC around the MoE."""

    def __init__(self, reg: ParameterRegistry, config: DeepseekV4Config, layer_idx: int, prefix: str | None = None):
        """``prefix``: the checkpoint names' prefix (``layers.N`` by default; ``mtp.K`` for a draft layer's block)."""
        c = config
        p = prefix or f"layers.{layer_idx}"
        hc, D = c.hc_mult, c.hidden_size
        self.config = c
        self.attn_norm = reg.add(f"{p}.attn_norm.weight", (D,))
        self.ffn_norm = reg.add(f"{p}.ffn_norm.weight", (D,))
        self.hc_attn = [reg.add(f"{p}.hc_attn_{n}", s) for n, s in _hc_shapes(hc, D)]
        self.hc_ffn = [reg.add(f"{p}.hc_ffn_{n}", s) for n, s in _hc_shapes(hc, D)]
        self.attn = Attention(reg, f"{p}.attn", c, layer_idx)
        self.ffn = MoE(reg, f"{p}.ffn", c, layer_idx)

    def __call__(self, ops: OpTable, streams: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        c = self.config
        mhc = (c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)
        post, comb, x = ops.hc_pre_normed(streams, *self.hc_attn, *mhc, self.attn_norm)  # x: [T, D]
        streams = ops.hc_post(streams, self.attn(ops, x, ctx), post, comb)  # [T, hc, D]
        post, comb, x = ops.hc_pre_normed(streams, *self.hc_ffn, *mhc, self.ffn_norm)
        routed, shared = self.ffn(ops, x, ctx.token_ids)  # [T, D] each
        return ops.hc_post_sum(streams, routed, shared, post, comb)


def _hc_shapes(hc: int, D: int):
    mix = (2 + hc) * hc
    return (("fn", (mix, hc * D)), ("base", (mix,)), ("scale", (3,)))


def _inference(fn):
    """Run ``fn`` under ``torch.inference_mode``, except while ``torch.compile`` traces it: the compiled decode step
    runs under ``no_grad`` instead (TorchInductor in torch 2.11 fails on inference mode around ordinary tensors,
    pytorch/pytorch#169477)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return run


@dataclasses.dataclass
class StepContext:
    """What every layer of one step shares: layout, state, RoPE tables, token ids."""

    layout: StepLayout
    state: DeepseekV4State
    token_ids: torch.Tensor
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # rope type -> (cos, sin) at token positions
    rope_args: dict[str, tuple]  # rope type -> (inv_freq, scaling, dtype) for other positions


class DeepseekV4Model:
    """DeepSeek-V4 causal LM over flat variable-length batches with explicit state (``models/interface.py``'s
    ``StaticStepModel``)."""

    def __init__(self, config: DeepseekV4Config, ops: OpTable, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", quantized: Mapping[str, QuantizedTensor] | None = None):
        """``quantized``: the checkpoint's quantized weights (``CheckpointPlan.quantized``), held as stored."""
        self.config = config
        self.ops = ops
        self.dtype = dtype
        self.device = torch.device(device)
        reg = ParameterRegistry(dtype, self.device, quantized)
        c = config
        self.embed = reg.add("embed.weight", (c.vocab_size, c.hidden_size))
        self.head = reg.add("head.weight", (c.vocab_size, c.hidden_size))
        self.norm = reg.add("norm.weight", (c.hidden_size,))
        self.hc_head = [reg.add(f"hc_head_{n}", s)
                        for n, s in (("fn", (c.hc_mult, c.hc_mult * c.hidden_size)), ("base", (c.hc_mult,)),
                                     ("scale", (1,)))]
        self.layers = [DecoderLayer(reg, c, i) for i in range(c.num_hidden_layers)]
        self.compressor_plans = self._compressor_plans()  # every step's layout builds these plans up front
        self.counted_ratios = tuple(sorted({layer.attn.compressor.ratio for layer in self.layers
                                            if layer.attn.sparse == "index" and layer.attn.indexer is not None}))
        self.parameters = reg.slots
        self._allocated = reg.allocated
        self.rope_inv_freq = {t: c.rope_inv_freq(t).to(self.device) for t in ("main", "compress")}
        self.rope_scaling = {t: float(c.rope_parameters[t].get("attention_factor", 1.0) or 1.0)
                             for t in ("main", "compress")}

    # ------------------------------------------------------------------ weights
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy canonical-named tensors into place (one at a time); returns the names loaded."""
        loaded = set()
        for name, tensor in tensors:
            slot = self.parameters.get(name)
            if slot is None:
                raise KeyError(f"unexpected tensor {name!r}: the model has no parameter of that name")
            if tuple(slot.shape) != tuple(tensor.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(slot.shape)}")
            slot.copy_(tensor)
            loaded.add(name)
        return loaded

    def missing_parameters(self, loaded: set[str]) -> list[str]:
        return sorted(set(self.parameters) - loaded)

    def held_bytes(self) -> HeldBytes:
        """Bytes of the weights held, by dtype (quantized weights and scales as stored)."""
        by_dtype: dict[str, int] = {}
        for tensor in self._allocated:
            key = str(tensor.dtype).removeprefix("torch.")
            by_dtype[key] = by_dtype.get(key, 0) + tensor.numel() * tensor.element_size()
        return HeldBytes(by_dtype)

    # ------------------------------------------------------------------ what the engine sizes
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.config.max_position_embeddings

    @property
    def block_multiple(self) -> int:
        return self.config.block_multiple

    @property
    def sliding_window(self) -> int:
        return self.config.sliding_window

    def state_bytes(self, block_size: int, dtype: torch.dtype) -> StateBytes:
        """Bytes of one paged block (compressed entries, indexer keys) and one slot (rings, carries)."""
        return StateBytes(DeepseekV4State.bytes_per_block(self.config, block_size, dtype),
                          DeepseekV4State.bytes_per_slot(self.config, block_size, dtype))

    def new_state(self, num_slots: int, num_blocks: int, block_size: int | None = None,
                  dtype: torch.dtype | None = None) -> DeepseekV4State:
        """Allocate state pools for ``num_slots`` running sequences and ``num_blocks`` paged blocks."""
        block_size = block_size or self.config.block_multiple
        return DeepseekV4State(self.config, num_slots, num_blocks, block_size, dtype or self.dtype, self.device)

    def prefix_replay_span(self) -> int:
        """Tokens to recompute before a prefix hit so every layer's window and carry are rebuilt exactly.

        Each layer's sliding window reaches ``W - 1`` tokens back, so wrong (missing) state at the replay's start
        stops mattering after ``num_layers * (W - 1)`` tokens; the compressor carry needs the last
        ``2 * csa_ratio`` tokens' inputs on top.
        """
        c = self.config
        ratios = [c.compress_ratio(i) for i in range(c.num_hidden_layers)]
        return c.num_hidden_layers * c.sliding_window + 2 * max(ratios, default=0)

    def slot_state_views(self, state: DeepseekV4State, slot: int) -> list[torch.Tensor]:
        """Every layer's sliding ring and every compressor carry of ``slot`` (``SlotStateModel``;
        ``DeepseekV4State.slot_views``)."""
        return state.slot_views(slot)

    def block_state_views(self, state: DeepseekV4State, block: int) -> list[torch.Tensor]:
        """Every compressed layer's entries and every indexer's keys in ``block`` (``SlotStateModel``;
        ``DeepseekV4State.block_views``)."""
        return state.block_views(block)

    # ------------------------------------------------------------------ speculative decoding
    @property
    def max_draft_tokens(self) -> int:
        """Draft tokens a sequence's step may carry: one less than its shortest ring (sliding window, carry spans),
        so the step's rows never overwrite each other and the rejected ones can be put back."""
        spans = [span for _, span in self.compressor_plans[0]]
        return min([self.config.sliding_window, *spans]) - 1

    def save_draft_state(self, state: DeepseekV4State, slots: list[int], positions: list[list[int]]) -> SavedRows:
        """The sliding-window and compressor-carry rows the draft ``positions`` will overwrite (``SpeculativeModel``);
        compressed entries and indexer keys need no save: an entry a rejected token completed is written again by the
        step that computes its window's last accepted token, and no query sees it before."""
        return state.save_positions(slots, positions)

    def save_draft_rows(self, state: DeepseekV4State, seq: torch.Tensor, slots: torch.Tensor,
                        positions: torch.Tensor) -> SavedRows:
        """``save_draft_state`` from device tensors ``[M]`` (sequence, slot, position of every row to save), by device
        ops of fixed shapes (``StaticVerifyModel``: a captured verification step saves inside its graph)."""
        return state.save_rows(seq, slots, positions)

    def rollback_draft_state(self, state: DeepseekV4State, saved: SavedRows, keep_until: torch.Tensor) -> None:
        """Put back the saved rows of the rejected positions (``>= keep_until[i]``) on the device."""
        state.restore_positions(saved, keep_until)

    # ------------------------------------------------------------------ expert parallelism
    def shard_experts(self, rank: int, world_size: int, group=None) -> None:
        """Keep this rank's share of every layer's routed experts; later forwards dispatch to their owners
        (``models/interface.py``'s ``ExpertParallelModel``; ``deepseek_v4/expert_parallel.py``)."""
        from deepinfer_core.models.deepseek_v4 import expert_parallel

        expert_parallel.shard_model(self, rank, world_size, group)

    def idle_step(self) -> None:
        """One forward's expert-parallel collectives with no tokens of this rank's own."""
        from deepinfer_core.models.deepseek_v4 import expert_parallel

        expert_parallel.idle_step(self)

    def expert_parallel_layout(self):
        """The experts' layout over the ranks after ``shard_experts`` (``ExpertBalancedModel``); None before."""
        from deepinfer_core.models.deepseek_v4 import expert_parallel

        return expert_parallel.layout(self)

    def record_expert_load(self, enabled: bool) -> None:
        """Count (or stop counting) tokens per logical expert in every MoE layer's router."""
        from deepinfer_core.models.deepseek_v4 import expert_parallel

        expert_parallel.record_load(self, enabled)

    def expert_load(self) -> torch.Tensor:
        """Tokens per logical expert since the last call ``[layers, n_routed_experts]``; the counters restart."""
        from deepinfer_core.models.deepseek_v4 import expert_parallel

        return expert_parallel.expert_load(self)

    def expert_slots(self, layer: int) -> tuple:
        """MoE layer ``layer``'s local expert weights, stacked by this rank's physical slot."""
        from deepinfer_core.models.deepseek_v4 import expert_parallel

        return expert_parallel.local_slots(self, layer)

    def set_expert_placement(self, layer: int, phy2log: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor,
                             weights: tuple) -> None:
        """Swap MoE layer ``layer``'s expert placement and this rank's weights for it together, between forwards."""
        from deepinfer_core.models.deepseek_v4 import expert_parallel

        expert_parallel.set_placement(self, layer, phy2log, log2phy, logcnt, weights)

    # ------------------------------------------------------------------ forward
    def step_layout(self, batch: ForwardBatch, state: DeepseekV4State, **static) -> StepLayout:
        """The index layout of one step over ``state``, built on the host (every compressor's plan with it);
        ``static``: ``StepLayout``'s arguments of a captured prefill step (``buffers``, ``written``, ...)."""
        return StepLayout(batch, self.config.sliding_window, state.block_size, self.device, *self.compressor_plans,
                          counted_ratios=self.counted_ratios,
                          **static)

    def place_prefill_inputs(self, batch: ForwardBatch, state: DeepseekV4State, buffers: StaticBuffers,
                             written: int, spare_block: int, context_len: int | None = None) -> StepLayout:
        """The host-built layout of a padded lone-chunk step (its first ``written`` tokens write state; it ends by
        ``context_len``), placed in ``buffers``; its visibility masks are left to ``prefill_layout``."""
        return self.step_layout(batch, state, buffers=buffers, written=[written], spare_block=spare_block,
                                masks=False, context_len=context_len)

    def prefill_layout(self, inputs: StepLayout) -> StepLayout:
        """The static prefill step's layout with its masks built (on the device, inside the graph)."""
        inputs.build_masks()
        return inputs

    def place_verify_inputs(self, batch: ForwardBatch, state: DeepseekV4State, buffers: StaticBuffers,
                            spare_block: int, context_len: int) -> StepLayout:
        """The host-built layout of a static verification step (``StaticVerifyModel``): ``batch`` has the same number
        of tokens per sequence (padding after each sequence's own, every token writing state), sequences end by
        ``context_len``; placed in ``buffers``, its masks left to ``verify_layout``."""
        return self.step_layout(batch, state, buffers=buffers, spare_block=spare_block, masks=False,
                                context_len=context_len, fixed_windows=True)

    def verify_layout(self, inputs: StepLayout) -> StepLayout:
        """The static verification step's layout with its masks built (on the device, inside the graph)."""
        inputs.build_masks()
        return inputs

    def prefill_min_tokens(self) -> int:
        """The shortest chunk a padded static prefill step takes: its written tail fills the sliding ring and every
        compressor's carry, so those writes keep one shape whatever the chunk's length."""
        spans = [span for _, span in self.compressor_plans[0]]
        return max([self.config.sliding_window, *spans])

    def place_decode_inputs(self, batch: ForwardBatch, state: DeepseekV4State, static: StaticShape,
                            buffers: StaticBuffers) -> DecodeInputs:
        """The per-sequence tensors a static decode step's layout is computed from (``batch``: one token per
        sequence), placed in ``buffers``."""
        return DecodeInputs.from_batch(batch, static, state.block_size).place(buffers)

    def decode_layout(self, inputs: DecodeInputs, state: DeepseekV4State, static: StaticShape) -> DecodeLayout:
        """The layout of a static decode step, computed by ops on ``inputs``' device (inside a captured graph)."""
        return DecodeLayout(inputs, self.config.sliding_window, state.block_size, static, self.ops)

    def static_shape(self, num_seqs: int, context_len: int, spare_slot: int, spare_block: int) -> StaticShape:
        """The static decode shape of ``num_seqs`` sequences no longer than ``context_len`` tokens."""
        return StaticShape(num_seqs, self.config.sliding_window, context_len, spare_slot, spare_block,
                           *self.compressor_plans)

    def _compressor_plans(self) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
        """The (ratio, span) of every compressor's windows and the ratio of every compressed cache, once each."""
        windows, ratios = [], []
        for layer in self.layers:
            attn = layer.attn
            for compressor in (attn.compressor, attn.indexer.compressor if attn.indexer else None):
                if compressor is not None:
                    windows.append((compressor.ratio, compressor.span))
                    ratios.append(compressor.ratio)
        return tuple(dict.fromkeys(windows)), tuple(dict.fromkeys(ratios))

    @_inference
    def forward(self, batch: ForwardBatch, state: DeepseekV4State, layout: StepLayout | None = None,
                capture_layers: Iterable[int] = (), return_hidden: bool = False) -> ModelOutput:
        """Run one step: fold the batch's tokens into ``state`` and return the requested logits.

        ``layout``: the batch's ``StepLayout`` when the caller built it (static decode steps); else built here.
        ``return_hidden``: also return every token's last-layer streams ``[T, hc, D]`` (before ``hc_head`` and the
        final norm: what an MTP draft layer's ``hnorm`` reads) as ``final_hidden``.
        """
        ops, c = self.ops, self.config
        layout = layout or self.step_layout(batch, state)
        rope_args = {t: (self.rope_inv_freq[t], self.rope_scaling[t], self.dtype) for t in ("main", "compress")}
        rope = {t: ops.rope_cos_sin(batch.positions, *rope_args[t]) for t in rope_args}
        ctx = StepContext(layout, state, batch.input_ids, rope, rope_args)
        hidden = ops.embed(batch.input_ids, self.embed)  # [T, D]
        streams = hidden.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()  # [T, hc, D]
        captured: dict[int, torch.Tensor] = {}
        wanted = set(capture_layers)
        for idx, layer in enumerate(self.layers):
            streams = layer(ops, streams, ctx)
            if idx in wanted:
                captured[idx] = streams
        rows = streams[batch.logits_rows]  # [N, hc, D]
        final = ops.hc_head(rows, *self.hc_head, c.hc_eps, c.rms_norm_eps)
        final = ops.rms_norm(final, self.norm, c.rms_norm_eps)
        return ModelOutput(ops.logits(final, self.head), captured, streams if return_hidden else None)

"""DeepSeek-V4 forward pass, written once against the op table.

The model holds plain tensors named by their canonical checkpoint names (DeepSeek's own:
``layers.N.attn.wq_a.weight``, ...); routed experts are stacked per layer (``[E, I, D]``) and each
``ffn.experts.E.w1.weight`` name addresses a view into the stack, so loading copies once.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterable

import torch

from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from deepinfer_core.models.deepseek_v4.layout import DecodeInputs, DecodeLayout, StaticShape, StepLayout
from deepinfer_core.models.deepseek_v4.state import CompressorCarry, DeepseekV4State, carry_span
from deepinfer_core.models.interface import ModelOutput, StateBytes
from deepinfer_core.ops.table import OpTable
from deepinfer_core.static_buffers import StaticBuffers

_FP32_SUFFIXES = ("norm.weight", "attn_sink", ".ape", "gate.bias")


def keeps_fp32(name: str) -> bool:
    """Parameters HF keeps in fp32 even in a bf16 model (norms, sinks, mHC, position bias, router bias)."""
    leaf = name.rsplit(".", 1)[-1]
    return name.endswith(_FP32_SUFFIXES) or leaf.startswith(("hc_attn_", "hc_ffn_", "hc_head_"))


class ParameterRegistry:
    """Canonical name -> the tensor (or stacked-expert view) a checkpoint tensor is copied into."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype = dtype
        self.device = device
        self.slots: dict[str, torch.Tensor] = {}

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """Allocate a parameter (or return its view in a fused tensor from ``add_fused``); fp32-kept names stay
        fp32 whatever the model dtype."""
        dtype = dtype or (torch.float32 if keeps_fp32(name) else self.dtype)
        if name in self.slots:
            tensor = self.slots[name]
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise ValueError(f"parameter {name!r} was allocated as {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"now asked for {tuple(shape)} {dtype}")
            return tensor
        tensor = torch.zeros(shape, dtype=dtype, device=self.device)
        self.slots[name] = tensor
        return tensor

    def add_fused(self, rows: dict[str, int], cols: int) -> torch.Tensor:
        """One ``[sum(rows), cols]`` tensor whose row blocks are the named weights (in order): projections of
        the same input then run as one GEMM, and each name still loads into its own block."""
        fused = torch.zeros((sum(rows.values()), cols), dtype=self.dtype, device=self.device)
        for name, block in zip(rows, fused.split(list(rows.values())), strict=True):
            self.slots[name] = block
        return fused

    def add_stacked(self, pattern: str, count: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Allocate ``[count, *shape]``; ``pattern.format(i)`` names slice ``i``."""
        stacked = torch.zeros((count, *shape), dtype=self.dtype, device=self.device)
        for i in range(count):
            self.slots[pattern.format(i)] = stacked[i]
        return stacked


class ExpertMap:
    """Logical expert id -> physical expert slot. Identity by default; EPLB assigns ``logical_to_physical`` a new
    ``[E]`` map (assign a new tensor: a write into the current one in place is not seen while it is the identity,
    which costs no gather)."""

    def __init__(self, num_experts: int, device: torch.device):
        self._map = torch.arange(num_experts, device=device)  # [E]
        self._identity = True

    @property
    def logical_to_physical(self) -> torch.Tensor:
        return self._map

    @logical_to_physical.setter
    def logical_to_physical(self, mapping: torch.Tensor) -> None:
        self._map = mapping
        self._identity = torch.equal(mapping.cpu(), torch.arange(mapping.shape[0]))

    def to_physical(self, logical_ids: torch.Tensor) -> torch.Tensor:
        return logical_ids if self._identity else self._map[logical_ids]


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
    and the scores are not computed (``indexer_topk`` returns ``visible`` then, whatever the scores)."""

    def __init__(self, reg: ParameterRegistry, prefix: str, config: DeepseekV4Config):
        self.heads, self.dim = config.index_n_heads, config.index_head_dim
        self.topk = config.index_topk
        self.wq_b = reg.add(f"{prefix}.wq_b.weight", (self.heads * self.dim, config.q_lora_rank))
        self.weights_proj = reg.add(f"{prefix}.weights_proj.weight", (self.heads, config.hidden_size))
        self.compressor = Compressor(reg, f"{prefix}.compressor", config, CSA, self.dim)

    def select(self, ops: OpTable, inputs: dict[str, torch.Tensor], q_residual, layout: StepLayout, keys_store,
               query_rope, folding):
        """Bool ``[S, Lq, E]``: which compressed entries each query attends to (``inputs``: the layer input's
        projections by role, ``Attention.project``; ``folding``: the fork folding this step's keys into
        ``keys_store``, joined before the scores read it)."""
        ratio = self.compressor.ratio
        visible = layout.entries(ratio).visible  # [S, Lq, E]
        if visible.shape[-1] <= self.topk:  # the budget covers every entry: top-k selects all visible ones, unscored
            return visible
        folding.join()
        keys = layout.gather_entries(keys_store, ratio)  # [S, E, di]
        q = ops.linear(q_residual, self.wq_b).view(-1, self.heads, self.dim)  # [T, Hi, di]
        q = ops.apply_rope_(q, *query_rope)
        head_weights = inputs["index_weights"].float() * self.heads**-0.5  # [T, Hi]
        scores = ops.indexer_scores(layout.pad(q), keys, layout.pad(head_weights), self.dim**-0.5)
        return ops.indexer_topk(scores, visible, self.topk)


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
        self.input_rows = [n for _, (_, n) in rows]
        self.w_input = reg.add_fused(dict(name_rows for _, name_rows in rows), c.hidden_size)  # [sum rows, D]
        starts = dict(zip(self.input_roles, itertools.accumulate([0, *self.input_rows]), strict=False))
        widths = dict(zip(self.input_roles, self.input_rows, strict=True))
        self.compressor_columns = {  # per compressor its kv, then gate columns (adjacent: ``_input_rows``)
            name: (starts[f"{name}_kv"], widths[f"{name}_kv"] + widths[f"{name}_gate"])
            for name in ("compress", "index") if f"{name}_kv" in starts}
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
            rows.append(("index_weights", (f"{prefix}.indexer.weights_proj.weight", c.index_n_heads)))
            index = _compressor_input_rows(f"{prefix}.indexer.compressor", CSA, c.index_head_dim)
            rows += zip(("index_kv", "index_gate"), index.items(), strict=True)
        return rows

    def project(self, ops: OpTable, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every projection of ``x [T, D]`` in one GEMM with the fused weight: role -> ``[T, rows]``; and per
        compressor (``compress``, ``index``) its kv and gate columns side by side, ``[T, 2 * width]``."""
        projected = ops.linear(x, self.w_input)  # [T, sum rows] in column blocks
        roles = dict(zip(self.input_roles, projected.split(self.input_rows, dim=-1), strict=True))
        roles.update({name: projected.narrow(-1, start, width)
                      for name, (start, width) in self.compressor_columns.items()})
        return roles

    def __call__(self, ops: OpTable, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        T = x.shape[0]
        inputs = self.project(ops, x)
        # the key path (this step's key, the compressed stores, the keys gathered) beside the query's (a backend may
        # overlap them); the indexer's store after it, needed before the attention only where the indexer scores
        keys = ops.fork(self._keys, ops, inputs, ctx)
        index_fold = ops.fork(self._fold_index, ops, inputs, ctx) if self.indexer is not None else None
        q_residual = ops.rms_norm(inputs["q"], self.q_norm, self.eps)  # [T, q_lora]
        q = ops.linear(q_residual, self.wq_b).view(T, self.heads, self.head_dim)  # [T, H, hd], normed in the attention
        keys = keys.join()  # [S, Lk (+ E), hd]
        layout = ctx.layout
        visible = layout.sliding_visible  # [S, Lq, Lk]
        if self.compressor is not None:
            entry_visible = self._entry_visible(ops, inputs, q_residual, ctx, index_fold)  # [S, Lq, E]
            visible = layout.attention_visible(self.compressor.ratio, entry_visible)  # [S, Lq, Lk + E]
        cos, sin = (layout.pad(t) for t in ctx.rope[self.rope_type])  # [S, Lq, rope_dim // 2] each
        out = ops.roped_sink_attention(layout.pad(q), keys, visible, self.sinks, self.head_dim**-0.5, self.eps, cos,
                                       sin)  # [S, Lq, H, hd]
        grouped = ops.grouped_linear(layout.unpad(out).reshape(T, self.groups, -1), self.wo_a, self.groups)
        out = ops.linear(grouped.flatten(1), self.wo_b)  # [T, D]
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
            keys = layout.attention_keys(ops, ring, kv, store, self.compressor.ratio)  # [S, Lk + E, hd]
        layout.write_ring(ops, ring, kv)
        return keys

    def _fold_index(self, ops: OpTable, inputs: dict[str, torch.Tensor], ctx: StepContext) -> None:
        """Fold this step's tokens into the indexer's key store (CSA layers)."""
        layer, state = self.layer_idx, ctx.state
        self.indexer.compressor.step(ops, inputs["index"], ctx.layout, state.index_keys[layer],
                                     state.index_carry[layer], ctx.rope_args["compress"])

    def _entry_visible(self, ops, inputs, q_residual, ctx: StepContext, index_fold) -> torch.Tensor:
        """Which compressed entries each query reads (``[S, Lq, E]``); the indexer's store is joined (``index_fold``)
        where the indexer scores."""
        visible = ctx.layout.entries(self.compressor.ratio).visible
        if self.indexer is not None:
            visible = self.indexer.select(ops, inputs, q_residual, ctx.layout, ctx.state.index_keys[self.layer_idx],
                                          ctx.rope["compress"], index_fold)
        return visible


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
        self.expert_map = ExpertMap(E, reg.device)
        self.record_load = False
        self.expert_load = torch.zeros(E, dtype=torch.long, device=reg.device)  # tokens per logical expert

    def __call__(self, ops: OpTable, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts' and the shared expert's outputs ``[T, D]`` (the block output is their sum)."""
        router_logits = ops.linear(x, self.gate)  # [T, E]; first: the routing's short chain leads to the experts
        shared = ops.fork(ops.swiglu_mlp, x, *self.shared, self.limit)  # beside the routing (a backend may overlap)
        if self.is_hash:
            weights, ids = ops.moe_route_hash(router_logits, token_ids, self.tid2eid, self.scaling, self.scoring)
        else:
            weights, ids = ops.moe_route_topk(router_logits, self.bias, self.top_k, self.scaling, self.scoring)
        if self.record_load:
            self.expert_load += torch.bincount(ids.reshape(-1), minlength=self.expert_load.shape[0])
        physical = self.expert_map.to_physical(ids)  # [T, k]
        routed = ops.moe_experts(x, physical, weights, self.w1, self.w2, self.w3, self.limit)
        return routed, shared.join()


class DecoderLayer:
    """mHC around attention, then mHC around the MoE."""

    def __init__(self, reg: ParameterRegistry, config: DeepseekV4Config, layer_idx: int):
        c = config
        p = f"layers.{layer_idx}"
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
                 device: torch.device | str = "cpu"):
        self.config = config
        self.ops = ops
        self.dtype = dtype
        self.device = torch.device(device)
        reg = ParameterRegistry(dtype, self.device)
        c = config
        self.embed = reg.add("embed.weight", (c.vocab_size, c.hidden_size))
        self.head = reg.add("head.weight", (c.vocab_size, c.hidden_size))
        self.norm = reg.add("norm.weight", (c.hidden_size,))
        self.hc_head = [reg.add(f"hc_head_{n}", s)
                        for n, s in (("fn", (c.hc_mult, c.hc_mult * c.hidden_size)), ("base", (c.hc_mult,)),
                                     ("scale", (1,)))]
        self.layers = [DecoderLayer(reg, c, i) for i in range(c.num_hidden_layers)]
        self.compressor_plans = self._compressor_plans()  # every step's layout builds these plans up front
        self.parameters = reg.slots
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

    # ------------------------------------------------------------------ forward
    def step_layout(self, batch: ForwardBatch, state: DeepseekV4State, **static) -> StepLayout:
        """The index layout of one step over ``state``, built on the host (every compressor's plan with it);
        ``static``: ``StepLayout``'s arguments of a captured prefill step (``buffers``, ``written``, ...)."""
        return StepLayout(batch, self.config.sliding_window, state.block_size, self.device, *self.compressor_plans,
                          **static)

    def place_prefill_inputs(self, batch: ForwardBatch, state: DeepseekV4State, buffers: StaticBuffers,
                             written: int, spare_block: int) -> StepLayout:
        """The host-built layout of a padded lone-prompt step (its first ``written`` tokens write state), placed in
        ``buffers``; its visibility masks are left to ``prefill_layout``."""
        return self.step_layout(batch, state, buffers=buffers, written=[written], spare_block=spare_block,
                                masks=False)

    def prefill_layout(self, inputs: StepLayout) -> StepLayout:
        """The static prefill step's layout with its masks built (on the device, inside the graph)."""
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
                capture_layers: Iterable[int] = ()) -> ModelOutput:
        """Run one step: fold the batch's tokens into ``state`` and return the requested logits.

        ``layout``: the batch's ``StepLayout`` when the caller built it (static decode steps); else built here.
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
        return ModelOutput(ops.logits(final, self.head), captured)

"""Roofline floors of an offline run (docs/performance.md, "The roofline").

* decode floor per step = max((weight bytes touched + state bytes read) / peak bandwidth, FLOPs / peak FLOP/s),
  where weight bytes touched = dense weights + shared experts + the expected unique routed experts of ``E`` with
  top-``k`` over ``B`` tokens (``E * (1 - (1 - k/E)^B)`` per MoE layer) + one embedding row per token + lm_head,
  and the state bytes are what attention reads at that context (:class:`AttentionShape`: the window, the top-k
  CSA entries, every HCA entry, every indexer key, the compressor carries);
* prefill floor per wave = max(FLOPs / peak FLOP/s, bytes / peak bandwidth): FLOPs = 2 * active parameters per
  computed token + each query's attention, indexer and compressor FLOPs; bytes = the weights the wave's tokens
  touch + the state it writes. The computed tokens are every prompt token, or the prompt tokens the run computed
  when prompts hit the prefix cache (``prefill_tokens``: uncached tokens plus the replay before a hit; each prompt
  then computes its last ``prefill_tokens / num_prompts`` positions).

Quantized weights count the bytes actually stored: an fp8 weight 1 B per value plus its block scales, an MXFP4
expert 0.5 B per value plus 1/32 B of ue8m0 scale (``quantized``: the checkpoint's ``CheckpointPlan.quantized``).
A quantized run also gets a second floor, ``fp8_floor_s`` / ``fp8_fraction``: the products of its quantized weights
at the device's fp8 peak (``DevicePeak.fp8_flops``), the rest at the bf16 one.
Only devices with measured peak numbers get a fraction; anything else reports ``n/a``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch

from deepinfer_core.models.deepseek_v4 import weights as v4_weights
from deepinfer_core.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config
from deepinfer_core.quant.tensors import QuantizedTensor


@dataclasses.dataclass(frozen=True)
class DevicePeak:
    """Measured ceilings of one device kind (bytes/s copy bandwidth, dense bf16 FLOP/s, dense fp8 FLOP/s)."""

    name: str
    bandwidth: float
    flops: float
    fp8_flops: float | None = None


# Measured ceilings: a device-to-device copy's bandwidth (read + write counted), a bf16 8192^3 matmul's FLOP/s and
# an fp8 8192^3 ``torch._scaled_mm``'s. Matched against torch.cuda.get_device_name().
KNOWN_PEAKS: dict[str, DevicePeak] = {"H200": DevicePeak("NVIDIA H200", 4.25e12, 799e12, 1415e12)}


def device_peak(device: torch.device | str) -> DevicePeak | None:
    """The peak numbers of ``device`` if it is a GPU this module knows, else None."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in KNOWN_PEAKS.items() if key in name), None)


def unavailable_reason(device: torch.device | str) -> str:
    """Why no roofline fraction is reported for ``device`` (for the table and JSON)."""
    device = torch.device(device)
    if device.type == "cpu":
        return "n/a (CPU)"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"n/a (no measured peak numbers for {name})"


def _sum_min(n: int, cap: int) -> int:
    """``sum(min(L, cap) for L in 1..n)``."""
    if n <= cap:
        return n * (n + 1) // 2
    return cap * (cap + 1) // 2 + (n - cap) * cap


def _sum_floor(n: int, m: int) -> int:
    """``sum(L // m for L in 1..n)``: ``m`` values of each ``j < q = n // m``, then ``n - q*m + 1`` of ``q``."""
    q, r = divmod(n, m)
    return m * q * (q - 1) // 2 + q * (r + 1)


def _sum_min_floor(n: int, m: int, k: int) -> int:
    """``sum(min(k, L // m) for L in 1..n)``: ``L // m`` reaches ``k`` at ``L = k*m``."""
    if n < k * m:
        return _sum_floor(n, m)
    return _sum_floor(k * m - 1, m) + k * (n - k * m + 1)


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """What attention, the indexer and the compressors compute and read per query, by layer type.

    ``L`` below is a query's context: the tokens it may see, itself included (position ``t`` has ``L = t + 1``).
    Keys per query: the window ``min(L, W)`` in every layer; CSA adds its top-k of the ``L // m_csa`` visible
    compressed entries, ``min(index_topk, L // m_csa)``; HCA adds all ``L // m_hca`` visible entries.
    """

    sliding_layers: int
    csa_layers: int
    hca_layers: int
    heads: int
    head_dim: int  # one shared K == V head of this width (MQA)
    window: int
    csa_ratio: int
    hca_ratio: int
    index_topk: int
    index_heads: int
    index_dim: int
    itemsize: int  # bytes per state element
    csa_carry_bytes: int  # one CSA layer's carries (kv + gate, attention and indexer) of one sequence
    hca_carry_bytes: int  # one HCA layer's carry of one sequence

    @classmethod
    def from_config(cls, config: DeepseekV4Config, dtype: torch.dtype, block_size: int) -> AttentionShape:
        """The counts of ``config`` with its state stored in ``dtype``."""
        from deepinfer_core.models.deepseek_v4.state import cache_groups

        types = config.layer_types
        carry = {g.name: g.bytes_per_unit(dtype) // len(g.layers) for g in cache_groups(config, block_size)
                 if g.name.endswith(":carry")}
        return cls(sliding_layers=types.count(SLIDING), csa_layers=types.count(CSA), hca_layers=types.count(HCA),
                   heads=config.num_attention_heads, head_dim=config.head_dim, window=config.sliding_window,
                   csa_ratio=config.compress_rates[CSA], hca_ratio=config.compress_rates[HCA],
                   index_topk=config.index_topk, index_heads=config.index_n_heads, index_dim=config.index_head_dim,
                   itemsize=torch.empty((), dtype=dtype).element_size(),
                   csa_carry_bytes=carry.get(f"{CSA}:carry", 0), hca_carry_bytes=carry.get(f"{HCA}:carry", 0))

    @property
    def layers(self) -> int:
        return self.sliding_layers + self.csa_layers + self.hca_layers

    def _per_key(self) -> int:
        """FLOPs per query and key: ``2 * heads * head_dim`` for the scores, as many for the values."""
        return 4 * self.heads * self.head_dim

    def _indexer_per_entry(self) -> int:
        """Indexer FLOPs per query and compressed entry: every head's dot product, then the head-weighted sum."""
        return 2 * self.index_heads * self.index_dim + 2 * self.index_heads

    def compressor_flops_per_token(self) -> int:
        """Pooling FLOPs per token (the projections are weights, in the active parameters): each entry is a
        weighted sum of its window's rows, ``2 * span * width / ratio`` per token; CSA windows overlap
        (span ``2 * m``) for the attention entry and the indexer key, HCA's do not (span ``m``)."""
        csa = 4 * (self.head_dim + self.index_dim)  # 2 * (2 * m) * width / m
        hca = 2 * self.head_dim  # 2 * m * width / m
        return self.csa_layers * csa + self.hca_layers * hca

    def query_flops(self, context: int) -> dict[str, int]:
        """FLOPs of one query with ``context`` visible tokens, summed over the layers of each type."""
        window = min(context, self.window)
        csa_seen, hca_seen = context // self.csa_ratio, context // self.hca_ratio
        return {
            "sliding": self.sliding_layers * self._per_key() * window,
            "csa": self.csa_layers * self._per_key() * (window + min(self.index_topk, csa_seen)),
            "hca": self.hca_layers * self._per_key() * (window + hca_seen),
            "indexer": self.csa_layers * self._indexer_per_entry() * csa_seen,
            "compressor": self.compressor_flops_per_token(),
        }

    def prefill_flops(self, end: int, start: int = 0) -> int:
        """Attention, indexer and compressor FLOPs of the queries at contexts ``start + 1 .. end`` (positions
        ``start .. end - 1`` of one prompt), from closed forms of the per-query counts."""
        def window(n: int) -> int:
            return _sum_min(n, self.window)

        def total(n: int) -> int:
            csa_keys = window(n) + _sum_min_floor(n, self.csa_ratio, self.index_topk)
            hca_keys = window(n) + _sum_floor(n, self.hca_ratio)
            keys = self.sliding_layers * window(n) + self.csa_layers * csa_keys + self.hca_layers * hca_keys
            indexer = self.csa_layers * self._indexer_per_entry() * _sum_floor(n, self.csa_ratio)
            return self._per_key() * keys + indexer + self.compressor_flops_per_token() * n

        return total(end) - total(start)

    def state_bytes(self, context: int) -> dict[str, float]:
        """State bytes one decode step of one sequence reads at ``context`` visible tokens, by layer type:
        every layer's window rows; CSA's selected entries, every visible indexer key and its carries; every
        visible HCA entry and its carry."""
        window_row, seen = min(context, self.window) * self.head_dim, context // self.csa_ratio
        csa = window_row + min(self.index_topk, seen) * self.head_dim + seen * self.index_dim
        hca = window_row + context // self.hca_ratio * self.head_dim
        return {
            "sliding": self.sliding_layers * window_row * self.itemsize,
            "csa": self.csa_layers * (csa * self.itemsize + self._carry(self.csa_carry_bytes, 2 * self.csa_ratio,
                                                                         self.csa_ratio)),
            "hca": self.hca_layers * (hca * self.itemsize + self._carry(self.hca_carry_bytes, self.hca_ratio,
                                                                         self.hca_ratio)),
        }

    @staticmethod
    def _carry(carry_bytes: int, span: int, ratio: int) -> float:
        """Carry bytes per step: the row the step writes, plus the ``span`` rows pooled once every ``ratio``
        steps (amortised)."""
        return carry_bytes / span + carry_bytes / ratio


@dataclasses.dataclass(frozen=True)
class ModelBytes:
    """Byte and parameter counts of a model that the floors need."""

    dense_bytes: int  # attention, routers, norms, hyper-connections (everything read every step)
    shared_bytes: int  # shared experts, all MoE layers
    expert_bytes: int  # one routed expert of one layer
    moe_layers: int
    n_experts: int
    top_k: int
    embed_row_bytes: int
    head_bytes: int
    active_params: int  # parameters one token multiplies through (no embedding)
    quantized_active_params: int  # of those, the ones stored quantized (fp8 blocks, MXFP4)
    state_bytes_per_token: float  # paged state per context token
    state_bytes_per_seq: int  # slot state per running sequence
    attention: AttentionShape  # per-query attention FLOPs and state reads

    def unique_experts(self, batch: int) -> float:
        """Expected distinct routed experts touched per MoE layer by ``batch`` tokens."""
        return self.n_experts * (1 - (1 - self.top_k / self.n_experts) ** batch)

    def weight_bytes_touched(self, batch: int) -> float:
        """Weight bytes one decode step of ``batch`` tokens must read."""
        experts = self.unique_experts(batch) * self.expert_bytes * self.moe_layers
        return self.dense_bytes + self.shared_bytes + experts + batch * self.embed_row_bytes + self.head_bytes


def model_bytes(config: DeepseekV4Config, dtype: torch.dtype, block_size: int | None = None,
                quantized: Mapping[str, QuantizedTensor] | None = None) -> ModelBytes:
    """Count a model's bytes by tensor class from its expected tensor shapes (``dtype`` for matrices, the stored
    bytes with scales for ``quantized`` ones)."""
    from deepinfer_core.models.deepseek_v4.state import DeepseekV4State

    sizes = {"dense": 0, "shared": 0, "routed": 0, "embed": 0, "head": 0}
    params, quantized_params = dict(sizes), dict(sizes)
    itemsize = torch.empty((), dtype=dtype).element_size()
    for name, (shape, kind) in v4_weights.expected_tensors(config).items():
        if kind == v4_weights.INT:  # hash-routing rows: one per token, negligible
            continue
        part = _tensor_class(name)
        if quantized and name in quantized:
            sizes[part] += quantized[name].nbytes
            quantized_params[part] += math.prod(shape)
        else:
            sizes[part] += math.prod(shape) * (itemsize if kind == v4_weights.WEIGHT else 4)
        params[part] += math.prod(shape)
    moe_layers = config.num_hidden_layers
    experts = max(moe_layers * config.n_routed_experts, 1)

    def active(part_params: dict[str, int]) -> int:  # dense + shared + head + top-k routed experts per MoE layer
        return (part_params["dense"] + part_params["shared"] + part_params["head"]
                + config.num_experts_per_tok * (part_params["routed"] // experts) * moe_layers)

    block = block_size or max(config.block_multiple, 16)
    return ModelBytes(
        dense_bytes=sizes["dense"], shared_bytes=sizes["shared"],
        expert_bytes=sizes["routed"] // experts, moe_layers=moe_layers,
        n_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
        embed_row_bytes=sizes["embed"] // config.vocab_size, head_bytes=sizes["head"],
        active_params=active(params), quantized_active_params=active(quantized_params),
        state_bytes_per_token=DeepseekV4State.bytes_per_block(config, block, dtype) / block,
        state_bytes_per_seq=DeepseekV4State.bytes_per_slot(config, block, dtype),
        attention=AttentionShape.from_config(config, dtype, block),
    )


def _tensor_class(name: str) -> str:
    if name == "embed.weight":
        return "embed"
    if name == "head.weight":
        return "head"
    if ".ffn.experts." in name:
        return "routed"
    if ".ffn.shared_experts." in name:
        return "shared"
    return "dense"


def run_floor(mb: ModelBytes, peak: DevicePeak, num_prompts: int, input_len: int, output_len: int,
              batch: int, prefill_tokens: int | None = None, fp8: bool = False) -> dict[str, float]:
    """Floors (seconds) of an offline run: prompts in waves of ``batch``, prefill then ``output_len - 1`` decodes.

    The first output token of each request comes out of its prefill step; each later token costs one
    decode step of the whole wave. ``prefill_tokens``: the prompt tokens computed (default all of them); ``fp8``:
    the quantized weights' products at the fp8 peak (``compute_seconds``).
    """
    computed = num_prompts * input_len if prefill_tokens is None else prefill_tokens
    per_prompt = min(input_len, round(computed / max(num_prompts, 1)))  # each prompt computes its last positions
    prefill = decode = 0.0
    for start in range(0, num_prompts, batch):
        wave = min(batch, num_prompts - start)
        prefill += prefill_wave_floor(mb, peak, wave, input_len, per_prompt, fp8)
        decode += sum(decode_step_floor(mb, peak, wave, input_len + step, fp8) for step in range(1, output_len))
    return {"prefill_floor_s": prefill, "decode_floor_s": decode, "floor_s": prefill + decode,
            "prefill_tokens": computed}


def compute_seconds(mb: ModelBytes, peak: DevicePeak, tokens: int, attention_flops: float, fp8: bool = False) -> float:
    """Seconds of ``tokens`` tokens' FLOPs (2 x active parameters each) plus ``attention_flops`` at the bf16 peak;
    with ``fp8`` the products of the quantized weights at the fp8 peak instead."""
    quantized = 2 * mb.quantized_active_params * tokens if fp8 and peak.fp8_flops else 0
    rest = 2 * mb.active_params * tokens - quantized + attention_flops
    return rest / peak.flops + (quantized / peak.fp8_flops if quantized else 0.0)


def prefill_wave_floor(mb: ModelBytes, peak: DevicePeak, wave: int, input_len: int, computed: int,
                       fp8: bool = False) -> float:
    """Seconds of one wave's prefill: ``wave`` prompts of ``input_len`` tokens computing their last ``computed``.

    FLOPs: 2 x active parameters per token + every query's attention, indexer and compressor FLOPs. Bytes: the
    weights the wave's tokens touch once + the state the prompts write (paged per token, plus each slot).
    """
    tokens = wave * computed
    attention = wave * mb.attention.prefill_flops(input_len, input_len - computed)
    state = wave * (computed * mb.state_bytes_per_token + mb.state_bytes_per_seq)
    return max(compute_seconds(mb, peak, tokens, attention, fp8),
               (mb.weight_bytes_touched(tokens) + state) / peak.bandwidth)


def decode_step_floor(mb: ModelBytes, peak: DevicePeak, wave: int, context: int, fp8: bool = False) -> float:
    """Seconds of one decode step of ``wave`` sequences whose query sees ``context`` tokens: the step's bytes
    (weights touched + each sequence's state reads) over bandwidth, or its FLOPs over peak FLOP/s if larger."""
    state = wave * sum(mb.attention.state_bytes(context).values())
    attention = wave * sum(mb.attention.query_flops(context).values())
    return max((mb.weight_bytes_touched(wave) + state) / peak.bandwidth,
               compute_seconds(mb, peak, wave, attention, fp8))


def roofline(config: DeepseekV4Config, dtype: torch.dtype, device: torch.device | str, measured_s: float,
             num_prompts: int, input_len: int, output_len: int, batch: int,
             quantized: Mapping[str, QuantizedTensor] | None = None,
             prefill_tokens: int | None = None) -> dict[str, float] | str:
    """The floor of a run and ``fraction`` = floor / measured, or the reason none applies (``"n/a (CPU)"``); for a
    quantized model on a device with an fp8 peak also ``fp8_floor_s``, ``fp8_prefill_floor_s`` and ``fp8_fraction``
    (its quantized weights' products at the fp8 peak)."""
    peak = device_peak(device)
    if peak is None:
        return unavailable_reason(device)
    mb = model_bytes(config, dtype, quantized=quantized)
    floors = run_floor(mb, peak, num_prompts, input_len, output_len, batch, prefill_tokens)
    result = {**floors, "measured_s": measured_s, "fraction": floors["floor_s"] / measured_s, "device": peak.name}
    if mb.quantized_active_params and peak.fp8_flops:
        fp8 = run_floor(mb, peak, num_prompts, input_len, output_len, batch, prefill_tokens, fp8=True)
        result |= {"fp8_floor_s": fp8["floor_s"], "fp8_prefill_floor_s": fp8["prefill_floor_s"],
                   "fp8_fraction": fp8["floor_s"] / measured_s}
    return result

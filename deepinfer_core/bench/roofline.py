"""Roofline floors of an offline run (docs/performance.md, "The roofline").

* decode floor per step = (weight bytes touched + state bytes read) / peak bandwidth, where weight bytes
  touched = dense weights + shared experts + the expected unique routed experts of ``E`` with top-``k``
  over ``B`` tokens (``E * (1 - (1 - k/E)^B)`` per MoE layer) + one embedding row per token + lm_head;
* prefill floor = 2 * active parameters * tokens / peak FLOP/s (attention FLOPs left out, so the floor
  is slightly optimistic for long prompts); the tokens are every prompt token, or the prompt tokens the run
  computed when prompts hit the prefix cache (``prefill_tokens``: uncached tokens plus the replay before a hit).

Quantized weights count the bytes actually stored: an fp8 weight 1 B per value plus its block scales, an MXFP4
expert 0.5 B per value plus 1/32 B of ue8m0 scale (``quantized``: the checkpoint's ``CheckpointPlan.quantized``).

State bytes read per sequence and step are approximated by the paged state of its context
(``bytes_per_block / block_size`` per token) plus its slot state (sliding ring, compressor carry). Only
devices with measured peak numbers get a fraction; anything else reports ``n/a``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch

from deepinfer_core.models.deepseek_v4 import weights as v4_weights
from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config
from deepinfer_core.quant.tensors import QuantizedTensor


@dataclasses.dataclass(frozen=True)
class DevicePeak:
    """Measured ceilings of one device kind (bytes/s copy bandwidth, dense bf16 FLOP/s)."""

    name: str
    bandwidth: float
    flops: float


# Measured ceilings: a device-to-device copy's bandwidth (read + write counted) and a bf16 8192^3 matmul's FLOP/s.
# Matched against torch.cuda.get_device_name().
KNOWN_PEAKS: dict[str, DevicePeak] = {"H200": DevicePeak("NVIDIA H200", 4.25e12, 799e12)}


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
    state_bytes_per_token: float  # paged state per context token
    state_bytes_per_seq: int  # slot state per running sequence

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
    params = dict(sizes)
    itemsize = torch.empty((), dtype=dtype).element_size()
    for name, (shape, kind) in v4_weights.expected_tensors(config).items():
        if kind == v4_weights.INT:  # hash-routing rows: one per token, negligible
            continue
        part = _tensor_class(name)
        if quantized and name in quantized:
            sizes[part] += quantized[name].nbytes
        else:
            sizes[part] += math.prod(shape) * (itemsize if kind == v4_weights.WEIGHT else 4)
        params[part] += math.prod(shape)
    moe_layers = config.num_hidden_layers
    expert_params = params["routed"] // max(moe_layers * config.n_routed_experts, 1)
    block = block_size or max(config.block_multiple, 16)
    return ModelBytes(
        dense_bytes=sizes["dense"], shared_bytes=sizes["shared"],
        expert_bytes=sizes["routed"] // max(moe_layers * config.n_routed_experts, 1), moe_layers=moe_layers,
        n_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
        embed_row_bytes=sizes["embed"] // config.vocab_size, head_bytes=sizes["head"],
        active_params=params["dense"] + params["shared"] + params["head"]
        + config.num_experts_per_tok * expert_params * moe_layers,
        state_bytes_per_token=DeepseekV4State.bytes_per_block(config, block, dtype) / block,
        state_bytes_per_seq=DeepseekV4State.bytes_per_slot(config, block, dtype),
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
              batch: int, prefill_tokens: int | None = None) -> dict[str, float]:
    """Floors (seconds) of an offline run: prompts in waves of ``batch``, prefill then ``output_len - 1`` decodes.

    The first output token of each request comes out of its prefill step; each later token costs one
    decode step of the whole wave. ``prefill_tokens``: the prompt tokens computed (default all of them).
    """
    computed = num_prompts * input_len if prefill_tokens is None else prefill_tokens
    prefill = 2 * mb.active_params * computed / peak.flops  # linear in tokens: the waves' sum
    decode = 0.0
    for start in range(0, num_prompts, batch):
        wave = min(batch, num_prompts - start)
        for step in range(1, output_len):
            context = input_len + step
            state = wave * (context * mb.state_bytes_per_token + mb.state_bytes_per_seq)
            decode += (mb.weight_bytes_touched(wave) + state) / peak.bandwidth
    return {"prefill_floor_s": prefill, "decode_floor_s": decode, "floor_s": prefill + decode,
            "prefill_tokens": computed}


def roofline(config: DeepseekV4Config, dtype: torch.dtype, device: torch.device | str, measured_s: float,
             num_prompts: int, input_len: int, output_len: int, batch: int,
             quantized: Mapping[str, QuantizedTensor] | None = None,
             prefill_tokens: int | None = None) -> dict[str, float] | str:
    """The floor of a run and ``fraction`` = floor / measured, or the reason none applies (``"n/a (CPU)"``)."""
    peak = device_peak(device)
    if peak is None:
        return unavailable_reason(device)
    floors = run_floor(model_bytes(config, dtype, quantized=quantized), peak, num_prompts, input_len, output_len,
                       batch, prefill_tokens)
    return {**floors, "measured_s": measured_s, "fraction": floors["floor_s"] / measured_s, "device": peak.name}

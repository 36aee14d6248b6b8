"""Random DeepSeek-V4 weights, drawn tensor by tensor: the bench presets' checkpoints and ``load_format="dummy"``.

Matrices are normal(0, ``WEIGHT_STD``), norms and scales 1, other vectors (biases, sinks, hyper-connection bases,
the compressors' position bias) 0, and the hash-routing tables (``tid2eid``) hold distinct random experts per token.
Tensors are drawn in canonical-name order from one generator seeded with ``seed`` on ``device``, so one (config,
seed, device) always gives the same bytes: a model loaded with ``load_format="dummy"`` holds exactly the weights the
bench preset of its config writes to disk. The draft layers (``mtp.K.*``) draw from a sub-stream of their own, so
the target's bytes do not depend on them. A quantized config's weights are drawn so, then quantized as ``deepinfer
quantize`` writes them (``loadable_tensors``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from deepinfer_core.checkpoint import convert_tensor
from deepinfer_core.models.deepseek_v4 import weights as v4_weights
from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config
from deepinfer_core.quant.tensors import QuantizedTensor
from deepinfer_core.quant.writer import QuantRecipe, planned_quantization, quantize_tensors
from deepinfer_core.sampling.noise import derive_seed

WEIGHT_STD = 0.02
DRAFT_STREAM = 1  # derive_seed sub-stream of the draft layers' weights
WEIGHT_DTYPE = torch.bfloat16  # the dtype the presets store and ``load_format="dummy"`` draws matrices in
DUMMY_SEED = 0  # ``load_format="dummy"``'s seed: the presets' default, so a dummy model holds their checkpoints' bytes

Drawn = tuple[str, torch.Tensor, str]  # (canonical name, tensor, kind)


def draft_tensor_specs(config: DeepseekV4Config) -> dict[str, v4_weights.Spec]:
    """``mtp.K.* -> (shape, kind)`` of the config's ``num_nextn_predict_layers`` draft layers (no confidence head,
    as V4 checkpoints ship them); empty without draft layers."""
    from deepinfer_core.models.deepseek_v4.mtp import expected_draft_tensors

    layers = config.num_nextn_predict_layers
    return expected_draft_tensors(config, layers, confidence_head=False) if layers > 0 else {}


def target_tensors(config: DeepseekV4Config, seed: int, weight_dtype: torch.dtype,
                   device: torch.device) -> Iterator[Drawn]:
    """``(canonical name, tensor, kind)`` of every tensor of the target model, drawn one at a time in name order."""
    gen = torch.Generator(device=device).manual_seed(seed)
    yield from _iter_drawn(v4_weights.expected_tensors(config), config, gen, weight_dtype, device)


def draft_tensors(config: DeepseekV4Config, seed: int, weight_dtype: torch.dtype,
                  device: torch.device) -> Iterator[Drawn]:
    """The draft layers' ``mtp.K.*`` tensors (``draft_tensor_specs``), drawn in name order from their own seed
    stream; nothing without draft layers."""
    specs = draft_tensor_specs(config)
    if specs:
        gen = torch.Generator(device=device).manual_seed(derive_seed(seed, DRAFT_STREAM) % 2**63)
        yield from _iter_drawn(specs, config, gen, weight_dtype, device)


def random_tensors(config: DeepseekV4Config, seed: int, weight_dtype: torch.dtype,
                   device: torch.device) -> Iterator[Drawn]:
    """The target's tensors (``target_tensors``), then its draft layers' (``draft_tensors``)."""
    yield from target_tensors(config, seed, weight_dtype, device)
    yield from draft_tensors(config, seed, weight_dtype, device)


def dummy_quantization(config: DeepseekV4Config, specs: Mapping[str, v4_weights.Spec] | None = None
                       ) -> tuple[QuantRecipe | None, dict[str, QuantizedTensor]]:
    """How ``load_format="dummy"`` stores the weights of ``config`` (of ``specs``, by default the target's): the
    writer's recipe for its ``quantization_config`` and what that recipe quantizes (canonical name -> format), or
    ``(None, {})`` for an unquantized config."""
    if config.quantization is None:
        return None, {}
    recipe = QuantRecipe.from_config(config.quantization)
    return recipe, planned_quantization(recipe, config, specs)


def dummy_weights(config: DeepseekV4Config, dtype: torch.dtype, device: torch.device | str, draft: bool = False
                  ) -> tuple[dict[str, QuantizedTensor], Iterator[tuple[str, torch.Tensor]]]:
    """What ``load_format="dummy"`` loads into the target model of ``config`` (``draft``: into its draft layers): the
    quantized weights' formats (``dummy_quantization``) and the ``(canonical name, tensor)`` pairs
    (``loadable_tensors`` of the tensors drawn with ``DUMMY_SEED`` on ``device``)."""
    recipe, quantized = dummy_quantization(config, draft_tensor_specs(config) if draft else None)
    draw = draft_tensors if draft else target_tensors
    drawn = draw(config, DUMMY_SEED, WEIGHT_DTYPE, torch.device(device))
    return quantized, loadable_tensors(drawn, recipe, dtype, device)


def loadable_tensors(drawn: Iterable[Drawn], recipe: QuantRecipe | None, dtype: torch.dtype,
                     device: torch.device | str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(canonical name, tensor)`` as the checkpoint loader hands them to a model: each weight ``recipe`` quantizes
    as the writer stores it, followed by its ``.scale`` (both held as stored), the rest converted to the model's
    ``dtype`` (float32 tensors to float32, tables to int64) on ``device``."""
    for name, tensor, kind in drawn:
        stored = [] if recipe is None else list(quantize_tensors(recipe, [(name, tensor, kind)]))
        if len(stored) < 2:
            yield name, convert_tensor(tensor, kind, dtype, device)
            continue
        for stored_name, stored_tensor in stored:
            yield stored_name, convert_tensor(stored_tensor, v4_weights.STORED, dtype, device)


def _iter_drawn(specs: Mapping[str, v4_weights.Spec], config: DeepseekV4Config, gen: torch.Generator,
                weight_dtype: torch.dtype, device: torch.device) -> Iterator[Drawn]:
    for name, (shape, kind) in sorted(specs.items()):
        if kind == v4_weights.INT:
            yield name, _random_tid2eid(shape, config.n_routed_experts, gen, device), kind
        else:
            yield name, _random_tensor(name, shape, kind, gen, weight_dtype, device), kind


def _random_tid2eid(shape: tuple[int, ...], experts: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Hash-routing table ``[vocab, top_k]``: ``top_k`` distinct random experts per token."""
    order = torch.rand((shape[0], experts), generator=gen, device=device).argsort(dim=1)
    return order[:, : shape[1]].to(torch.int64)


def _random_tensor(name: str, shape: tuple[int, ...], kind: str, gen: torch.Generator,
                   weight_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Matrices normal(0, std); norms and scales 1; other vectors (biases, sinks, bases, APE) 0."""
    dtype = weight_dtype if kind == v4_weights.WEIGHT else torch.float32
    if name.endswith(".ape"):  # the compressors' additive position bias
        return torch.zeros(shape, dtype=dtype, device=device)
    if len(shape) >= 2:  # every matrix, including the fp32 hyper-connection mixers
        return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * WEIGHT_STD).to(dtype)
    if "norm" in name or name.endswith("_scale"):
        return torch.ones(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)  # biases, sinks, hc bases, compressor APE

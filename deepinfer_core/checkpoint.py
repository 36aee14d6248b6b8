"""Streaming safetensors checkpoint reader.

Loading is two passes. :func:`plan_checkpoint` reads only the shard headers (names, shapes, dtypes)
and checks them against the model's expected tensors, so missing, unexpected and mis-shaped tensors
are all reported before any tensor data is read. :func:`iter_checkpoint` then opens the shards one at
a time and yields ``(canonical_name, tensor)`` pairs; a consumer copies each tensor into its
parameter and drops it, so peak host memory is about one tensor on top of the mmapped shard.

Pickle checkpoints (``*.bin``, ``*.pt``, ``*.pth``) are never loaded.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from deepinfer_core.errors import DeepInferError
from deepinfer_core.models.deepseek_v4 import weights as v4_weights
from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config
from deepinfer_core.quant import tensors as quant_tensors
from deepinfer_core.quant.config import QuantizationConfig
from deepinfer_core.quant.tensors import QuantizedTensor

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_INT_DTYPES = {"I64", "I32", "I16", "I8", "U8"}
_MAX_LISTED = 20


class CheckpointError(DeepInferError, ValueError):
    """A checkpoint folder that cannot be loaded, with the tensor at fault and what to do."""


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """Where one canonical tensor comes from: a shard file, an on-disk name, and maybe a slice."""

    name: str  # canonical name
    source: str  # name in the shard file
    shard: str  # shard file name, relative to the checkpoint folder
    shape: tuple[int, ...]  # shape of the canonical tensor (after slicing)
    kind: str  # weights.WEIGHT / FP32 / INT
    index: tuple[slice, ...] | None = None  # slice of a fused tensor; leading dim squeezed


@dataclasses.dataclass
class CheckpointPlan:
    """What a checkpoint holds relative to what the model expects, built from headers only."""

    folder: Path
    shards: list[str]
    sources: dict[str, TensorSource]
    missing: list[tuple[str, tuple[int, ...]]] = dataclasses.field(default_factory=list)
    unexpected: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (on-disk name, shard)
    # (canonical name, expected shape, found shape, shard, on-disk name)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...], str, str]] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)  # mtp.* tensors
    quantized: dict[str, QuantizedTensor] = dataclasses.field(default_factory=dict)  # canonical weight name -> format

    @property
    def ok(self) -> bool:
        """True when nothing is missing, unexpected or mis-shaped."""
        return not (self.missing or self.unexpected or self.mismatched)

    def raise_for_problems(self) -> None:
        """Raise one CheckpointError listing every missing, unexpected and mis-shaped tensor."""
        if self.ok:
            return
        lines = [f"checkpoint {self.folder} does not match the model config:"]
        lines += _listed(self.mismatched, _describe_mismatch)
        lines += _listed(self.missing, lambda m: f"missing tensor: {m[0]} (expected shape {m[1]})")
        lines += _listed(self.unexpected, lambda u: f"unexpected tensor: {u[0]} in {u[1]}")
        lines.append(
            "Check that config.json belongs to these weights (layer counts, hidden sizes, expert counts) "
            "and that the shards are complete; re-download or re-convert the checkpoint if files are missing."
        )
        raise CheckpointError("\n  ".join(lines))


@dataclasses.dataclass
class LoadReport:
    """Summary of a finished load."""

    loaded: int
    skipped: int  # mtp.* tensors not loaded
    shards: int


# ---------------------------------------------------------------------------------------------- files
def list_shards(folder: str | Path) -> list[str]:
    """Safetensors shard file names of a checkpoint folder, in read order.

    Uses ``model.safetensors.index.json`` when present, else ``model.safetensors``, else every
    ``*.safetensors`` file. Raises CheckpointError for pickle-only or empty folders.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist or is not a directory")
    index = folder / INDEX_FILE
    if index.is_file():
        shards = sorted(set(_read_weight_map(index).values()))
    elif (folder / SINGLE_FILE).is_file():
        shards = [SINGLE_FILE]
    else:
        shards = sorted(p.name for p in folder.glob("*.safetensors"))
    if not shards:
        _raise_no_safetensors(folder)
    for shard in shards:
        if not (folder / shard).is_file():
            raise CheckpointError(f"{INDEX_FILE} in {folder} names shard {shard}, which is missing; re-download it")
    return shards


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {exc}") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard files")
    return weight_map


def _raise_no_safetensors(folder: Path) -> None:
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{folder} holds only pickle checkpoints ({', '.join(pickles[:5])}); pickle checkpoints are not "
            "loaded; convert to safetensors (e.g. load with transformers and save_pretrained(safe_serialization=True))"
        )
    raise CheckpointError(f"no *.safetensors files in {folder}; point the engine at a safetensors checkpoint folder "
                          "(or pass load_format='dummy' to time the model of its config.json with random weights)")


def open_shard(path: Path):
    """``safe_open(path)`` (use it in a ``with``); a truncated or corrupt file raises one CheckpointError naming the
    file and what is wrong with it."""
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as exc:
        reason = str(exc).removeprefix("Error while deserializing header: ")
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({path.stat().st_size} bytes; {reason}): it is truncated "
            "or corrupt; re-download or re-convert it") from None


# ---------------------------------------------------------------------------------------------- planning
def read_headers(folder: str | Path) -> dict[str, dict[str, tuple[tuple[int, ...], str]]]:
    """``{shard: {name: (shape, safetensors dtype)}}`` read from the shard headers, one shard at a time."""
    folder = Path(folder)
    headers = {}
    for shard in list_shards(folder):
        with open_shard(folder / shard) as handle:
            names = handle.keys()
            headers[shard] = {name: _header(handle.get_slice(name)) for name in names}
    _check_index(folder, headers)
    return headers


def _header(tensor_slice) -> tuple[tuple[int, ...], str]:
    return tuple(tensor_slice.get_shape()), tensor_slice.get_dtype()


def _check_index(folder: Path, headers: Mapping[str, Mapping[str, Any]]) -> None:
    index = folder / INDEX_FILE
    if not index.is_file():
        return
    for name, shard in _read_weight_map(index).items():
        if name not in headers.get(shard, {}):
            raise CheckpointError(
                f"{INDEX_FILE} in {folder} puts tensor {name} in {shard}, but that shard does not hold it; "
                "the index and shards are out of sync: re-download the checkpoint"
            )


def plan_checkpoint(folder: str | Path, config: DeepseekV4Config, expected: Mapping[str, v4_weights.Spec] | None = None,
                    rename: Callable[[str], str | None] | None = None) -> CheckpointPlan:
    """Match a checkpoint's headers against ``config``'s expected tensors; reads no tensor data.

    By default the target model's tensors (``expected_tensors(config)``, names through ``canonical_name``; ``mtp.*``
    skipped). ``expected`` and ``rename`` plan another part of the checkpoint the same way (a draft layer's
    ``mtp.K.*``: ``deepseek_v4/mtp.py``): ``rename`` maps an on-disk name to its name in ``expected``, or to None for
    a tensor of another part (skipped)."""
    folder = Path(folder)
    expected = v4_weights.expected_tensors(config) if expected is None else expected
    rename = rename or v4_weights.canonical_name
    headers = read_headers(folder)
    plan = CheckpointPlan(folder=folder, shards=list(headers), sources={})
    scales = _take_scales(headers, rename)
    for shard, tensors in headers.items():
        for name, (shape, dtype) in tensors.items():
            _plan_tensor(plan, expected, config, name, shape, dtype, shard, scales, rename)
    _check_unused_scales(plan, scales, headers)
    _alias_tied_head(plan, expected, config)
    plan.missing = [(name, spec[0]) for name, spec in expected.items() if name not in plan.sources]
    plan.missing = [m for m in plan.missing if not _shape_reported(plan, m[0])]
    return plan


def _plan_tensor(plan, expected, config, name: str, shape, dtype: str, shard: str, scales, rename) -> None:
    canonical = rename(name)
    if canonical is None:
        plan.skipped.append(name)
        return
    if v4_weights.is_fused(canonical):
        _plan_fused(plan, expected, config, canonical, name, shape, dtype, shard)
        return
    if canonical not in expected:
        plan.unexpected.append((name, shard))
        return
    want, kind = expected[canonical]
    if kind == v4_weights.WEIGHT and dtype in _QUANTIZED_DTYPES:
        _plan_quantized(plan, config, canonical, name, shape, dtype, shard, scales.pop(canonical, None), want)
        return
    _check_dtype(name, dtype, kind, shard)
    if shape != want:
        plan.mismatched.append((canonical, want, shape, shard, name))
        return
    _add_source(plan, TensorSource(canonical, name, shard, shape, kind))


def _plan_fused(plan, expected, config, canonical: str, name: str, shape, dtype: str, shard: str) -> None:
    pieces = v4_weights.fused_pieces(canonical, config)
    if not pieces or pieces[0][0] not in expected:
        plan.unexpected.append((name, shard))
        return
    _check_dtype(name, dtype, v4_weights.WEIGHT, shard)
    want = v4_weights.fused_shape(canonical, config)
    if shape != want:
        plan.mismatched.append((canonical, want, shape, shard, name))
        return
    for piece, index in pieces:
        _add_source(plan, TensorSource(piece, name, shard, expected[piece][0], expected[piece][1], index))


def _add_source(plan: CheckpointPlan, source: TensorSource) -> None:
    previous = plan.sources.get(source.name)
    if previous is not None:
        raise CheckpointError(
            f"tensor {source.name} appears twice: as {previous.source} in {previous.shard} and as "
            f"{source.source} in {source.shard}; remove one copy (the checkpoint mixes naming schemes)"
        )
    plan.sources[source.name] = source


def _check_dtype(name: str, dtype: str, kind: str, shard: str) -> None:
    is_int = kind == v4_weights.INT
    if dtype in (_INT_DTYPES if is_int else _FLOAT_DTYPES):
        return
    wanted = "an integer" if is_int else "a bf16, fp16 or fp32"
    hint = ("fp8 / fp4 weights load from DeepSeek's per-expert names (layers.N.ffn.experts.E.w1.weight) with a "
            "sibling .scale, not from fused expert tensors" if dtype in _QUANTIZED_DTYPES else
            "re-convert the checkpoint")
    raise CheckpointError(f"tensor {name} in {shard} has dtype {dtype}; expected {wanted} tensor: {hint}")


# ---------------------------------------------------------------------------------------------- quantized tensors
_QUANTIZED_DTYPES = {"F8_E4M3", "F8_E5M2", "I8", "U8"}  # a linear weight stored so is quantized (with its .scale)
_FP8_SCALE_DTYPES = ("F8_E8M0", "F32")
_MXFP4_SCALE_DTYPES = ("F8_E8M0",)
_UNQUANTIZED_ONLY = ("embed.weight", "head.weight")  # a table lookup and the logits op read float weights


@dataclasses.dataclass(frozen=True)
class _Scale:
    """An ``X.scale`` tensor of the checkpoint, as its header describes it."""

    source: str
    shard: str
    shape: tuple[int, ...]
    dtype: str


def _take_scales(headers: dict[str, dict[str, tuple]], rename: Callable[[str], str | None]) -> dict[str, _Scale]:
    """Take every ``X.scale`` tensor out of ``headers``; return them by the planned name of their ``X.weight``."""
    scales = {}
    for shard, tensors in headers.items():
        for name in [n for n in tensors if _is_scale(n)]:
            shape, dtype = tensors.pop(name)
            weight = rename(quant_tensors.weight_name(name))
            if weight is not None:  # scales of skipped weights (mtp.* for the target) are skipped with them
                scales[weight] = _Scale(name, shard, shape, dtype)
    return scales


def _is_scale(name: str) -> bool:
    """``X.scale`` beside a quantized ``X.weight`` (HF's ``attn_hc.scale`` is the mHC scale ``hc_attn_scale``)."""
    canonical = v4_weights.canonical_name(name)
    return name.endswith(quant_tensors.SCALE_SUFFIX) and (canonical is None or canonical.endswith(".scale"))


def _plan_quantized(plan: CheckpointPlan, config: DeepseekV4Config, canonical: str, name: str, shape, dtype: str,
                    shard: str, scale: _Scale | None, want: tuple[int, ...]) -> None:
    """Plan a quantized weight and its scale, or raise CheckpointError naming the tensor at fault."""
    where = f"tensor {name} in {shard}"
    quant = config.quantization
    if quant is None:
        raise CheckpointError(f"{where} is {dtype}, a quantized dtype, but config.json has no quantization_config; "
                              "add the quantization_config the checkpoint was written with (docs/quantization.md)")
    if canonical in _UNQUANTIZED_ONLY:
        raise CheckpointError(f"{where} is {dtype}; the embedding and the head are read unquantized: store them as "
                              "bf16, fp16 or fp32")
    if scale is None:
        raise CheckpointError(f"{where} is {dtype} but its scale {quant_tensors.scale_name(name)} is missing; a "
                              "quantized weight needs its scale: re-download or re-write the checkpoint")
    spec = _quantized_spec(quant, canonical, where, dtype, scale, want)
    if spec.stored_shape != tuple(shape):
        plan.mismatched.append((canonical, spec.stored_shape, tuple(shape), shard, name))
        return
    if spec.scale_shape != tuple(scale.shape):
        raise CheckpointError(f"scale {scale.source} in {scale.shard} has shape {tuple(scale.shape)}; weight {name} "
                              f"({spec.format}, {list(spec.shape)} dequantized, scale blocks {list(spec.block)}) needs "
                              f"{spec.scale_shape}: check weight_block_size in config.json's quantization_config")
    plan.quantized[canonical] = spec
    _add_source(plan, TensorSource(canonical, name, shard, tuple(shape), v4_weights.STORED))
    _add_source(plan, TensorSource(quant_tensors.scale_name(canonical), scale.source, scale.shard,
                                   tuple(scale.shape), v4_weights.STORED))


def _quantized_spec(quant: QuantizationConfig, canonical: str, where: str, dtype: str, scale: _Scale,
                    want: tuple[int, ...]) -> QuantizedTensor:
    """What the dtype of a quantized weight and the config say it is: fp8 blocks or MXFP4."""
    expert = ".ffn.experts." in canonical
    if dtype == "F8_E5M2":
        raise CheckpointError(f"{where} is float8_e5m2; DeepSeek-V4 checkpoints store fp8 weights as e4m3 "
                              "(float8_e4m3fn): re-write it with deepinfer quantize")
    if dtype == "F8_E4M3":
        if expert and quant.expert_dtype != "fp8":
            raise CheckpointError(f"{where} is an fp8 routed expert, but config.json's expert_dtype is "
                                  f"{quant.expert_dtype!r}; set \"expert_dtype\": \"fp8\" for fp8 experts")
        _check_scale_dtype(scale, _FP8_SCALE_DTYPES, "an fp8 block weight's")
        return QuantizedTensor(canonical, quant_tensors.FP8_BLOCK, want, quant.weight_block_size,
                               quant_tensors.SAFETENSORS_DTYPES[scale.dtype])
    if not expert:
        raise CheckpointError(f"{where} is {dtype} with a scale: packed fp4 (MXFP4) is read for routed experts "
                              "(layers.N.ffn.experts.E.w1/w2/w3) only; store this weight as fp8, bf16 or fp32")
    if quant.expert_dtype != "fp4":
        raise CheckpointError(f"{where} is a packed fp4 expert, but config.json's expert_dtype is "
                              f"{quant.expert_dtype!r}; set \"expert_dtype\": \"fp4\" for MXFP4 experts")
    if want[-1] % 32:
        raise CheckpointError(f"{where} is a packed fp4 expert of input width {want[-1]}; MXFP4 scales groups of 32 "
                              "inputs, so the width must be a multiple of 32: keep this model's experts in fp8 or bf16")
    _check_scale_dtype(scale, _MXFP4_SCALE_DTYPES, "an MXFP4 expert's")
    return QuantizedTensor(canonical, quant_tensors.MXFP4, want, (1, 32), torch.float8_e8m0fnu)


def _check_scale_dtype(scale: _Scale, allowed: tuple[str, ...], whose: str) -> None:
    if scale.dtype not in allowed:
        raise CheckpointError(f"scale {scale.source} in {scale.shard} has dtype {scale.dtype}; {whose} scale is "
                              f"{' or '.join(allowed)} (F8_E8M0: ue8m0 powers of two): re-write the checkpoint")


def _check_unused_scales(plan: CheckpointPlan, scales: dict[str, _Scale], headers) -> None:
    """A scale beside an unquantized weight is an error; a scale with no weight at all is an unexpected tensor."""
    for weight, scale in scales.items():
        source = plan.sources.get(weight)
        if source is None:
            plan.unexpected.append((scale.source, scale.shard))
            continue
        dtype = headers[source.shard][source.source][1]
        raise CheckpointError(f"scale {scale.source} in {scale.shard} sits beside {source.source}, which is {dtype}, "
                              "not a quantized dtype (fp8 e4m3, or int8 / uint8 for MXFP4 experts): drop the scale "
                              "or store the weight quantized")


def _alias_tied_head(plan: CheckpointPlan, expected, config: DeepseekV4Config) -> None:
    """With tied embeddings and no ``head.weight`` on disk, load the embedding as the head too."""
    embed = plan.sources.get("embed.weight")
    if config.tie_word_embeddings and embed is not None and "head.weight" not in plan.sources:
        plan.sources["head.weight"] = dataclasses.replace(embed, name="head.weight")


def _shape_reported(plan: CheckpointPlan, name: str) -> bool:
    """A tensor (or its fused parent) already reported as mis-shaped is not also reported missing."""
    reported = {m[0] for m in plan.mismatched}
    if name in reported:
        return True
    if ".ffn.experts." not in name:
        return False
    prefix = name.split(".ffn.experts.")[0]
    fused = v4_weights.FUSED_DOWN if name.endswith(".w2.weight") else v4_weights.FUSED_GATE_UP
    return f"{prefix}.{fused}" in reported


def _describe_mismatch(m: tuple) -> str:
    canonical, want, found, shard, source = m
    where = f"{shard} (as {source})" if source != canonical else shard
    return f"shape mismatch: {canonical} expected shape {want}, found {found} in {where}"


def _listed(items: list, describe: Callable[[Any], str]) -> list[str]:
    lines = [describe(item) for item in items[:_MAX_LISTED]]
    if len(items) > _MAX_LISTED:
        lines.append(f"... and {len(items) - _MAX_LISTED} more like these")
    return lines


# ---------------------------------------------------------------------------------------------- reading
def iter_checkpoint(
    plan: CheckpointPlan, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(canonical_name, tensor)`` shard by shard, holding one shard open at a time.

    WEIGHT tensors are converted to ``dtype``, FP32 tensors to float32 (or to ``dtype`` when that is
    float32/float64), INT tensors to int64; all land on ``device``. Pieces of fused expert tensors are
    read as slices, so a fused ``[E, 2I, D]`` tensor is never materialised whole.
    """
    by_shard: dict[str, list[TensorSource]] = {shard: [] for shard in plan.shards}
    for source in plan.sources.values():
        by_shard[source.shard].append(source)
    for shard in plan.shards:
        if not by_shard[shard]:
            continue
        with open_shard(plan.folder / shard) as handle:
            for source in by_shard[shard]:
                yield source.name, convert_tensor(_read(handle, source), source.kind, dtype, device)


def _read(handle, source: TensorSource) -> torch.Tensor:
    if source.index is None:
        return handle.get_tensor(source.source)
    return handle.get_slice(source.source)[source.index].squeeze(0)


def convert_tensor(tensor: torch.Tensor, kind: str, dtype: torch.dtype, device) -> torch.Tensor:
    """``tensor`` as a model of ``dtype`` on ``device`` holds a tensor of ``kind``: WEIGHT in ``dtype``, FP32 in
    float32 (or ``dtype`` when wider), INT as int64, STORED (quantized weights and scales) with its bytes as read."""
    if kind == v4_weights.STORED:  # quantized weights and scales keep their bytes; packed fp4 is held as uint8
        stored = tensor.view(torch.uint8) if tensor.dtype == torch.int8 else tensor
        return stored.to(device=device)
    if kind == v4_weights.INT:
        target = torch.int64
    elif kind == v4_weights.FP32 and dtype.itemsize < 4:
        target = torch.float32
    else:
        target = dtype
    if target.itemsize < tensor.dtype.itemsize:
        return tensor.to(dtype=target).to(device=device)
    return tensor.to(device=device).to(dtype=target)


def load_checkpoint(
    folder: str | Path,
    config: DeepseekV4Config,
    dtype: torch.dtype,
    device: torch.device | str,
    consume: Callable[[str, torch.Tensor], None],
    plan: CheckpointPlan | None = None,
) -> LoadReport:
    """Validate a checkpoint against ``config`` (headers only), then stream every tensor into ``consume``.

    Raises CheckpointError before reading any tensor data when tensors are missing, unexpected or
    mis-shaped. ``consume(name, tensor)`` is called once per canonical name (see
    ``deepinfer_core.models.deepseek_v4.weights.expected_tensors``); it should copy the tensor into
    its parameter and not keep a reference, so host memory stays bounded by one shard. ``plan``: the folder's
    ``plan_checkpoint`` when the caller made it already (to size the model by its quantized tensors).
    """
    plan = plan or plan_checkpoint(folder, config)
    plan.raise_for_problems()
    loaded = 0
    for name, tensor in iter_checkpoint(plan, dtype, device):
        consume(name, tensor)
        loaded += 1
    return LoadReport(loaded=loaded, skipped=len(plan.skipped), shards=len(plan.shards))


# ---------------------------------------------------------------------------------------------- writing
def write_checkpoint(
    folder: str | Path,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    config_dict: Mapping[str, Any] | None,
    max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
    """Write ``tensors`` (a mapping, or ``(name, tensor)`` pairs consumed one at a time) as safetensors shards, plus
    ``config.json`` when ``config_dict`` is given.

    One shard is written as ``model.safetensors``; several as ``model-0000i-of-0000n.safetensors`` with a
    ``model.safetensors.index.json`` weight map. Tensors go into shards in the given order, a new shard
    starting when the next tensor would push the current one past ``max_shard_bytes``; each shard is saved as
    soon as it is full, so memory stays around one shard. Returns the shard file names.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pending: list[Path] = []
    weight_maps: list[list[str]] = []
    total = 0
    for group in _groups_by_size(tensors.items() if isinstance(tensors, Mapping) else tensors, max_shard_bytes):
        pending.append(folder / f".shard-{len(pending):05d}.tmp")
        save_file(group, str(pending[-1]), metadata={"format": "pt"})
        weight_maps.append(list(group))
        total += sum(t.numel() * t.element_size() for t in group.values())
    names = [SINGLE_FILE] if len(pending) == 1 else [
        f"model-{i + 1:05d}-of-{len(pending):05d}.safetensors" for i in range(len(pending))
    ]
    for tmp, name in zip(pending, names, strict=True):
        tmp.rename(folder / name)
    if len(names) > 1:
        weight_map = {tensor: shard for shard, group in zip(names, weight_maps, strict=True) for tensor in group}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))
    if config_dict is not None:
        (folder / "config.json").write_text(json.dumps(dict(config_dict), indent=2))
    return names


def _groups_by_size(tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int
                    ) -> Iterator[dict[str, torch.Tensor]]:
    """Savable copies of ``tensors`` in consecutive groups of at most ``max_shard_bytes`` (a larger tensor alone);
    always at least one group."""
    group: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if group and size + nbytes > max_shard_bytes:
            yield group
            group, size = {}, 0
        group[name] = _savable(tensor)
        size += nbytes
    yield group


def _savable(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy with its own storage (safetensors refuses shared or strided tensors)."""
    return tensor.detach().to("cpu").contiguous().clone()


def dtype_from_name(name: str) -> torch.dtype:
    """``"bf16"``/``"bfloat16"``/``"fp16"``/``"float16"``/``"fp32"``/``"float32"`` -> torch dtype."""
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
             "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}
    if name not in table:
        raise CheckpointError(f"unknown dtype {name!r}; use one of {sorted(table)}")
    return table[name]


def plan_numel(plan: CheckpointPlan) -> int:
    """Total element count of the planned canonical tensors (handy for progress bars)."""
    return sum(math.prod(s.shape) for s in plan.sources.values())

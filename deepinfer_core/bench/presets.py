"""Named benchmark model shapes, written as random-weight checkpoints that load through the normal path.

A preset is an HF ``DeepseekV4Config`` dict. :func:`ensure_preset` writes it once into a cache folder as a
real checkpoint (``config.json``, ``model.safetensors`` shards through
:func:`deepinfer_core.checkpoint.write_checkpoint` under the names HF ``save_pretrained`` uses, and a
word-level ``tokenizer.json``), so both the engine and HF transformers load it from disk like any other
model. Random weights: matrices normal(0, 0.02), norms and scales 1,
biases 0, hash-routing tables (``tid2eid``) random distinct experts per token.

Presets:

* ``tiny``: the embedded default model's shape (``tools/train_tiny.py``: 4 layers, hidden 256, vocab 4096,
  about 5 M parameters), random weights. Fine on CPU.
* ``tiny-mtp``: ``tiny`` plus one MTP draft layer (``mtp.0.*``, random weights), for the ``mtp`` / ``dspark``
  speculative-decoding methods on CPU.
* ``v4-flash-8l64e``: DeepSeek-V4-Flash per-layer shapes with 8 layers and 64 experts (15.08 B parameters,
  30 GB in bf16). GPU only; never create it in tests.
* ``v4-flash-8l64e-1m``: the same shapes with V4-Flash's position range (1,048,576) and RoPE: plain RoPE (theta
  10,000) in sliding layers, yarn (theta 160,000, factor 16 over 65,536 original positions, beta 32 / 1,
  attention factor 1.0) in compressed ones. ``v4-flash-8l64e`` keeps 65,536 positions and plain RoPE. Its folder
  hard-links ``v4-flash-8l64e``'s weight files (the same tensors), so both cost the disk 30 GB, not 60.
* ``v4-flash-8l64e-mtp``: ``v4-flash-8l64e`` plus one MTP draft layer (V4-Flash has one), so the ``mtp`` and
  ``dspark`` methods run on it. Its folder hard-links ``v4-flash-8l64e``'s weight files and writes only the draft
  layer's tensors (1.78 B parameters, 3.6 GB in bf16) into an extra shard, with an index over both. A random draft layer
  drafts tokens the target almost never accepts: what the preset measures is the draft and verify steps' cost.
* ``v4-flash-8l64e-fp4``: the same weights written through ``deepinfer quantize --experts fp4 --linear fp8``
  (MXFP4 experts, fp8 128 x 128 blocks with ue8m0 scales; 10.1 GB), like for like with the bf16 preset.
* ``v4-flash-20l-fp4``: V4-Flash's 256 routed experts and per-layer shapes with 20 layers, written quantized as
  DeepSeek ships V4-Flash (73.5 GB: fits one H200). Drawn and quantized tensor by tensor, never whole in bf16.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from deepinfer_core import envs
from deepinfer_core.errors import DeepInferError
from deepinfer_core.models.deepseek_v4 import weights as v4_weights
from deepinfer_core.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config
from deepinfer_core.models.deepseek_v4.random_weights import (
    WEIGHT_STD,
    draft_tensor_specs,
    draft_tensors,
    random_tensors,
)
from deepinfer_core.quant.writer import QuantRecipe, quantize_tensors, quantized_config

MARKER_FILE = "bench_preset.json"  # written last: a folder without it is incomplete and is rebuilt
DRAFT_SHARD = "model-mtp.safetensors"  # a preset's draft layers beside shared target weights (``weights_of``)
_HF_TOP_LEVEL = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}


class PresetError(DeepInferError, ValueError):
    """An unknown preset name, or a preset that cannot be built here."""


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named benchmark model: its HF config dict, weight dtype on disk and where it can run."""

    name: str
    description: str
    config: Mapping[str, Any]
    weight_dtype: torch.dtype = torch.bfloat16
    gpu_only: bool = False
    quantize: QuantRecipe | None = None  # written through ``deepinfer quantize``'s writer with this recipe
    weights_of: str | None = None  # a preset with the same tensors: its weight files are shared (hard links)

    def config_dict(self, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The config.json content (a deep copy) with ``overrides`` applied on top."""
        config = json.loads(json.dumps(dict(self.config)))
        config.update(json.loads(json.dumps(dict(overrides or {}))))
        return config


def _common(vocab_size: int, max_positions: int) -> dict[str, Any]:
    """Config fields every preset spells out, so HF and the engine parse config.json identically."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": vocab_size,
        "max_position_embeddings": max_positions,
        "num_key_value_heads": 1,
        "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1.0e-6,
        "rms_norm_eps": 1.0e-6,
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 64 / 512},
            "compress": {"rope_type": "default", "rope_theta": 160000.0, "partial_rotary_factor": 64 / 512},
        },
        "num_nextn_predict_layers": 0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def _tiny_config() -> dict[str, Any]:
    """``tools/train_tiny.py``'s ``model_config_kwargs(4096)`` (tests check the two agree)."""
    config = _common(vocab_size=4096, max_positions=1024)
    config["rope_parameters"]["main"]["partial_rotary_factor"] = 0.25
    config["rope_parameters"]["compress"]["partial_rotary_factor"] = 0.25
    config.update(
        hidden_size=256, num_hidden_layers=4, layer_types=[SLIDING, CSA, HCA, CSA],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], compress_rates={CSA: 4, HCA: 128},
        sliding_window=128, num_attention_heads=4, head_dim=64, partial_rotary_factor=0.25, q_lora_rank=128,
        o_groups=2, o_lora_rank=128, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
        index_n_heads=4, index_head_dim=32, index_topk=256, hc_mult=4,
    )
    return config


def _flash_8l64e_config() -> dict[str, Any]:
    """``v4-flash-8l64e``: V4-Flash per-layer shapes, 8 layers, 64 routed experts."""
    config = _common(vocab_size=129280, max_positions=65536)
    config.update(
        hidden_size=4096, num_hidden_layers=8, layer_types=[SLIDING, SLIDING] + [CSA, HCA] * 3,
        mlp_layer_types=["hash_moe"] + ["moe"] * 7, compress_rates={CSA: 4, HCA: 128}, sliding_window=128,
        num_attention_heads=64, head_dim=512, partial_rotary_factor=64 / 512, q_lora_rank=1024, o_groups=8,
        o_lora_rank=1024, n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=2048,
        index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4,
    )
    return config


# V4-Flash's position range and RoPE (its config.json's ``rope_scaling``; HF transformers' DeepseekV4Config applies
# the yarn part to the compressed layers only, with attention_factor 1.0; sliding layers keep plain RoPE).
FLASH_MAX_POSITIONS = 1_048_576
FLASH_COMPRESS_ROPE = {"rope_type": "yarn", "rope_theta": 160000.0, "partial_rotary_factor": 64 / 512, "factor": 16,
                       "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1,
                       "attention_factor": 1.0}


def _flash_8l64e_1m_config() -> dict[str, Any]:
    """``v4-flash-8l64e-1m``: ``v4-flash-8l64e`` with V4-Flash's 1,048,576 positions and yarn-scaled RoPE."""
    config = _flash_8l64e_config()
    config["max_position_embeddings"] = FLASH_MAX_POSITIONS
    config["rope_parameters"]["compress"] = dict(FLASH_COMPRESS_ROPE)
    return config


def _with_mtp(config: dict[str, Any], layers: int = 1) -> dict[str, Any]:
    """``config`` with ``layers`` MTP draft layers (``mtp.K.*``)."""
    return {**config, "num_nextn_predict_layers": layers}


def _flash_20l_config() -> dict[str, Any]:
    """``v4-flash-20l-fp4``: V4-Flash per-layer shapes and its 256 routed experts, 20 layers (3 hash-routed)."""
    config = _flash_8l64e_config()
    config.update(num_hidden_layers=20, layer_types=[SLIDING, SLIDING] + [CSA, HCA] * 9,
                  mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 17, n_routed_experts=256)
    return config


FLASH_FP4 = QuantRecipe(experts="fp4", linear="fp8", block=128)  # how DeepSeek ships V4-Flash

PRESETS: dict[str, Preset] = {
    "tiny": Preset("tiny", "the embedded default model's shape (~5 M params), random weights", _tiny_config()),
    "tiny-mtp": Preset("tiny-mtp", "tiny plus one MTP draft layer (random weights: for mtp / dspark on CPU)",
                       _with_mtp(_tiny_config()), weights_of="tiny"),
    "v4-flash-8l64e": Preset("v4-flash-8l64e", "V4-Flash layer shapes, 8 layers, 64 experts (15.08 B params, GPU)",
                             _flash_8l64e_config(), gpu_only=True),
    "v4-flash-8l64e-1m": Preset("v4-flash-8l64e-1m", "v4-flash-8l64e with V4-Flash's 1,048,576 positions and "
                                "yarn RoPE (GPU)", _flash_8l64e_1m_config(), gpu_only=True,
                                weights_of="v4-flash-8l64e"),
    "v4-flash-8l64e-mtp": Preset("v4-flash-8l64e-mtp", "v4-flash-8l64e plus one MTP draft layer, random weights "
                                 "(mtp / dspark step costs, GPU)", _with_mtp(_flash_8l64e_config()), gpu_only=True,
                                 weights_of="v4-flash-8l64e"),
    "v4-flash-8l64e-fp4": Preset("v4-flash-8l64e-fp4", "v4-flash-8l64e with MXFP4 experts and fp8 linears (GPU)",
                                 _flash_8l64e_config(), gpu_only=True, quantize=FLASH_FP4),
    "v4-flash-20l-fp4": Preset("v4-flash-20l-fp4", "V4-Flash layer shapes, 20 layers, 256 experts, MXFP4 experts "
                               "and fp8 linears (73.5 GB, GPU)", _flash_20l_config(), gpu_only=True, quantize=FLASH_FP4),
}


def get_preset(name: str) -> Preset:
    """The preset called ``name``; raises PresetError listing the known names."""
    if name not in PRESETS:
        raise PresetError(f"unknown bench preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def count_parameters(config_dict: Mapping[str, Any], draft: bool = False) -> int:
    """Parameters of a checkpoint of this config, the target's (``draft``: its MTP draft layers') (from the expected
    tensor shapes; nothing is allocated)."""
    config = DeepseekV4Config.from_dict(dict(config_dict))
    specs = draft_tensor_specs(config) if draft else v4_weights.expected_tensors(config)
    return sum(math.prod(shape) for shape, _ in specs.values())


def hf_saved_name(canonical: str) -> str:
    """The tensor name HF ``save_pretrained`` writes for a canonical (DeepSeek) name."""
    if canonical in _HF_TOP_LEVEL:
        return _HF_TOP_LEVEL[canonical]
    return f"model.{canonical}"


# ------------------------------------------------------------------------------------------------ cache
def default_cache_dir() -> Path:
    """``$DEEPINFER_BENCH_CACHE``, else ``$XDG_CACHE_HOME/deepinfer/bench``, else ``~/.cache/deepinfer/bench``."""
    given = envs.DEEPINFER_BENCH_CACHE
    if given is not None:
        return given
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "deepinfer" / "bench"


def preset_folder(name: str, config_dict: Mapping[str, Any], seed: int, cache_dir: Path) -> Path:
    """The cache folder of one (preset, config, seed): the name plus a hash of what determines the bytes."""
    key = json.dumps({"config": config_dict, "seed": seed, "std": WEIGHT_STD}, sort_keys=True)
    return cache_dir / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def ensure_preset(
    name: str,
    cache_dir: str | os.PathLike | None = None,
    overrides: Mapping[str, Any] | None = None,
    seed: int = 0,
    device: torch.device | str | None = None,
    weights: bool = True,
) -> Path:
    """Return the checkpoint folder of preset ``name``, writing it first if the cache does not hold it.

    ``overrides`` change config fields (tests shrink the tiny preset); ``device`` is where the random
    weights are drawn (a GPU is much faster for the big preset; the bytes depend on the device's
    generator). ``weights=False``: a folder of its own with config.json and the tokenizer only, for
    ``load_format="dummy"``, which draws the same weights (seed 0) on the device at load time. Raises PresetError
    for unknown names and for a GPU-only preset when no GPU is present.
    """
    preset = get_preset(name)
    if preset.gpu_only and not torch.cuda.is_available():
        raise PresetError(f"preset {name!r} ({preset.description}) needs a GPU; use --preset tiny on CPU")
    config = preset.config_dict(overrides)
    device = torch.device(device or ("cuda" if preset.gpu_only else "cpu"))
    key = {**config, "_device": device.type} if weights else {**config, "_weights": False}
    folder = preset_folder(name, key, seed, Path(cache_dir or default_cache_dir()))
    if (folder / MARKER_FILE).is_file():
        return folder
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if not weights:
        tmp.mkdir(parents=True)
        stored = quantized_config(config, preset.quantize) if preset.quantize else config
        (tmp / "config.json").write_text(json.dumps(stored, indent=2))
        write_word_tokenizer(tmp, DeepseekV4Config.from_dict(dict(config)).vocab_size)
    elif preset.weights_of is not None and not overrides:
        base = ensure_preset(preset.weights_of, cache_dir, seed=seed, device=device)
        base_config = get_preset(preset.weights_of).config_dict()
        _share_weights(base, tmp, config, base_config)
        if config.get("num_nextn_predict_layers", 0) != base_config.get("num_nextn_predict_layers", 0):
            _add_draft_shard(tmp, config, seed, preset.weight_dtype, device)
    else:
        write_random_checkpoint(tmp, config, seed=seed, weight_dtype=preset.weight_dtype, device=device,
                                quantize=preset.quantize)
    (tmp / MARKER_FILE).write_text(json.dumps({"preset": name, "seed": seed, "device": device.type, "weights": weights,
                                               "parameters": count_parameters(config),
                                               "draft_parameters": count_parameters(config, draft=True)}, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def _share_weights(base: Path, folder: Path, config: Mapping[str, Any], base_config: Mapping[str, Any]) -> None:
    """Fill ``folder`` with hard links to ``base``'s weight and tokenizer files (copies across file systems) and
    ``config``'s own config.json: presets that differ only in config fields (or in draft layers, which
    ``_add_draft_shard`` adds) read the same bytes, written once."""
    tensors = v4_weights.expected_tensors(DeepseekV4Config.from_dict(dict(config)))
    if tensors != v4_weights.expected_tensors(DeepseekV4Config.from_dict(dict(base_config))):
        raise PresetError(f"cannot share the weights of {base.name}: the tensor shapes differ")
    folder.mkdir(parents=True)
    for path in base.iterdir():
        if path.name in ("config.json", MARKER_FILE):
            continue
        try:
            os.link(path, folder / path.name)
        except OSError:
            shutil.copy2(path, folder / path.name)
    (folder / "config.json").write_text(json.dumps(dict(config), indent=2))


def _add_draft_shard(folder: Path, config_dict: Mapping[str, Any], seed: int, weight_dtype: torch.dtype,
                     device: torch.device) -> None:
    """Write ``config_dict``'s draft layers (random, ``random_weights.draft_tensors``) into ``DRAFT_SHARD`` beside the linked
    target shards of ``folder``, and an index over all of them (a new file, not the base's linked one)."""
    from safetensors.torch import save_file

    from deepinfer_core.checkpoint import INDEX_FILE, read_headers

    weight_map = {name: shard for shard, names in read_headers(folder).items() for name in names}
    config = DeepseekV4Config.from_dict(dict(config_dict))
    draft = {hf_saved_name(name): tensor.detach().to("cpu").contiguous()
             for name, tensor, _ in draft_tensors(config, seed, weight_dtype, device)}
    save_file(draft, str(folder / DRAFT_SHARD), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(draft, DRAFT_SHARD))
    total = sum((folder / shard).stat().st_size for shard in set(weight_map.values()))
    (folder / INDEX_FILE).unlink(missing_ok=True)  # a hard link to the base's index: never written through
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2))


# ------------------------------------------------------------------------------------------------ writing
def write_random_checkpoint(
    folder: str | os.PathLike,
    config_dict: Mapping[str, Any],
    seed: int = 0,
    weight_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    quantize: QuantRecipe | None = None,
) -> Path:
    """Write a random-weight checkpoint of ``config_dict`` plus a word-level tokenizer into ``folder``, tensor by
    tensor; with ``quantize``, each weight goes through the quantized writer (DeepSeek's names and format)."""
    from deepinfer_core.checkpoint import write_checkpoint

    folder = Path(folder)
    config = DeepseekV4Config.from_dict(dict(config_dict))
    tensors = random_tensors(config, seed, weight_dtype, torch.device(device))
    if quantize is None:
        write_checkpoint(folder, ((hf_saved_name(name), t) for name, t, _ in tensors), config_dict)
    else:
        write_checkpoint(folder, quantize_tensors(quantize, tensors), quantized_config(dict(config_dict), quantize))
    write_word_tokenizer(folder, config.vocab_size)
    return folder


def write_word_tokenizer(folder: str | os.PathLike, vocab_size: int) -> None:
    """A word-level tokenizer ``<|bos|> <|eos|> <|pad|> w3 .. w{V-1}`` (benchmarks use token ids, not text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<|bos|>", "<|eos|>", "<|pad|>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|eos|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    folder = Path(folder)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>", "add_bos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

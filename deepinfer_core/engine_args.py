"""``EngineArgs``: every engine argument ``LLM`` and the CLI take, with vLLM's names, validated in one place."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from deepinfer_core.errors import DeepInferError
from deepinfer_core.options import parse_flag
from deepinfer_core.sampling.logits_processor import check_processors

logger = logging.getLogger("deepinfer")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
DUMMY = "dummy"  # load_format: random weights, only config.json read
LOAD_FORMATS = ("auto", "safetensors", DUMMY)


class EngineArgsError(DeepInferError, ValueError):
    """An engine argument with a value it cannot take; the message names the argument and what it accepts."""


@dataclasses.dataclass
class EngineArgs:
    """What the user asks of an engine; ``LLM(model, **kwargs)`` fills it from keyword arguments.

    Attributes:
        model: checkpoint folder, hub id in the local HF cache, or None for ``$DEEPINFER_HF_MODEL_DIR`` or the
            embedded tiny default model.
        backend: backend name (``cpu``, ``nvidia_sm100``, ...); default ``$DEEPINFER_ACCELERATOR`` or automatic.
        dtype: ``"auto"`` (float32 on CPU, bfloat16 on accelerators), or a torch dtype / name.
        tokenizer: a folder with tokenizer.json to use instead of the checkpoint's.
        max_model_len: longest prompt + output in tokens (default: the model's max_position_embeddings).
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: token budget per step (default: the backend's ``default_max_num_batched_tokens``).
        kv_cache_memory_bytes: bytes for the model state (paged blocks and per-sequence slots); default a fraction
            (``gpu_memory_utilization``) of free device memory, or up to 2 GiB on CPU.
        gpu_memory_utilization: the fraction of free device memory the state may take by default (``memory_fraction``
            is an older name for it).
        block_size: tokens per state block (a multiple of the model's ``block_multiple``).
        enable_prefix_caching: share full blocks of identical prefixes between requests.
        enable_prefix_state_cache: keep running sequences' per-sequence state (sliding windows, compressor carries)
            at block boundaries in device memory, so a prefix hit restores it and computes only the tokens after the
            hit instead of rebuilding it (``engine/prefix_state_cache.py``). None (default): on with prefix caching,
            for a model that can copy its slot state (``SlotStateModel``) and without speculative decoding.
        prefix_state_cache_bytes: device memory for that cache; taken out of the state budget when the budget comes
            from free device memory, else (``kv_cache_memory_bytes`` given) on top of it. Default: 16 entries of one
            slot's state per sequence slot, at most 1/8 of the state budget (at least one entry per slot).
        prefix_state_split_min_tokens: an admitted prompt chunk of at least this many tokens that finishes the prompt
            ends one token before the prompt's end and keeps the state there, so the same prompt sent again is
            restored there and computes only its last token (as vLLM's full hit does); such a miss costs one decode
            step more (its last token runs as a one-token row, through the decode graphs). Default 256 (shorter
            prompts' hits recompute them whole: the exact rebuild spans more); 0 never splits.
        seed: base seed for requests without ``SamplingParams.seed``.
        enforce_eager: never replay steps from captured device graphs.
        cuda_graph_sizes: decode batch sizes to capture; default ``1, 2, 4, 8, 16, 24, 32, 48, 64, ...`` up to
            ``max_num_seqs`` on a backend with device graphs, none on one without (CPU). Given explicitly on CPU,
            decode steps take the same static-shape path, run eagerly.
        prefill_graph_buckets: token counts of the captured prefill steps for lone prompts (each prompt padded to
            the next); default ``128, 256, 512, ..., 8192`` up to ``max_num_batched_tokens`` wherever decode steps
            replay graphs; ``[]`` turns them off.
        enable_mixed_chunk: decode running requests in the steps that prefill prompts too (vLLM's way; SGLang's
            ``--enable-mixed-chunk``). Off by default (SGLang's default): while prompt tokens wait, a step folds
            only those, and the running requests decode in the steps between.
        async_scheduling: plan and launch each step before the previous step's tokens are read, so the host's
            per-step work overlaps the device's; the outputs are the same. Default: the backend's
            ``default_async_scheduling`` (on for NVIDIA, off on CPU).
        tensor_parallel_size: accepted so vLLM code runs; one device per engine for now.
        data_parallel_size: ranks, each with its own engine on a share of the requests (docs/distributed.md);
            ``LLM`` starts them itself, or each process of a torchrun launch is one (1, the default, takes
            torchrun's world size).
        enable_expert_parallel: split the routed experts across the data-parallel ranks (rank r holds experts
            ``[r * E / N, (r + 1) * E / N)``), tokens reaching them by all-to-all; off: every rank holds them all.
        trust_remote_code: accepted so vLLM code runs; no code from a checkpoint is ever executed.
        load_format: ``"auto"`` / ``"safetensors"``: the checkpoint's safetensors shards; ``"dummy"`` (vLLM's name):
            nothing but config.json is read, the weights are random (the bench presets' values, quantized as
            config.json's ``quantization_config`` declares): for timing, e.g. a model no checkpoint of which fits
            the disk. Pickle formats are never loaded.
        logits_processors: logits processors for every request (``deepinfer_core.sampling.LogitsProcessor``, or
            any callable ``processor(logits, rows) -> logits``), instances, run before the plugins' processors.
        speculative_config: vLLM's dict for speculative decoding, e.g. ``{"method": "ngram",
            "num_speculative_tokens": 3}`` (docs/speculative.md); checked against the registered proposers when the
            engine is built. None: ``$DEEPINFER_USE_NEXTN_DECODE`` (DSpark with that many tokens), else none.
        options: feature options claimed by plugins (e.g. ``batch_invariant=True``); an option no loaded plugin
            claims is an error.
    """

    model: str | os.PathLike | None = None
    backend: str | None = None
    dtype: str | torch.dtype = "auto"
    tokenizer: str | os.PathLike | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int | None = None
    enable_prefix_caching: bool = True
    enable_prefix_state_cache: bool | None = None
    prefix_state_cache_bytes: int | None = None
    prefix_state_split_min_tokens: int | None = None
    seed: int = 0
    enforce_eager: bool = False
    cuda_graph_sizes: Sequence[int] | None = None
    prefill_graph_buckets: Sequence[int] | None = None
    enable_mixed_chunk: bool = False
    async_scheduling: bool | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    trust_remote_code: bool = False
    load_format: str = "auto"
    logits_processors: Sequence[Callable[..., Any]] = ()
    speculative_config: Mapping[str, Any] | None = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_kwargs(cls, model: str | os.PathLike | None = None, **kwargs: Any) -> EngineArgs:
        """Engine arguments from keyword arguments; keywords that are not engine arguments are feature options
        for plugins. ``memory_fraction`` is taken as ``gpu_memory_utilization``."""
        if "memory_fraction" in kwargs:
            fraction = kwargs.pop("memory_fraction")
            kwargs.setdefault("gpu_memory_utilization", fraction)
        names = {f.name for f in dataclasses.fields(cls)} - {"model", "options"}
        known = {k: v for k, v in kwargs.items() if k in names}
        options = {k: v for k, v in kwargs.items() if k not in names}
        return cls(model=model, **known, options=options)

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs)
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes", "block_size"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name))
        for name in ("cuda_graph_sizes", "prefill_graph_buckets"):
            values = getattr(self, name)
            if values is not None:
                bad = [n for n in values if not _is_positive_int(n)]
                if bad:
                    raise EngineArgsError(f"{name} must be positive integers, got {bad}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise EngineArgsError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        self._check_prefix_state_cache()
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise EngineArgsError(f"async_scheduling must be True, False or None (the backend's default), "
                                  f"got {self.async_scheduling!r}")
        if self.tensor_parallel_size != 1:
            raise EngineArgsError(f"tensor_parallel_size={self.tensor_parallel_size}: this engine runs one device "
                                  "per engine for now; use tensor_parallel_size=1")
        _check_int("data_parallel_size", self.data_parallel_size)
        if not isinstance(self.enable_expert_parallel, bool):
            raise EngineArgsError(f"enable_expert_parallel must be True or False, got {self.enable_expert_parallel!r}")
        if not isinstance(self.dtype, torch.dtype) and self.dtype != "auto" and self.dtype not in DTYPES:
            raise EngineArgsError(f"unknown dtype {self.dtype!r}; use 'auto', {sorted(DTYPES)} or a torch.dtype")
        try:
            self.logits_processors = check_processors(self.logits_processors, "logits_processors")
        except TypeError as exc:
            raise EngineArgsError(str(exc)) from None
        if self.speculative_config is not None and not isinstance(self.speculative_config, Mapping):
            raise EngineArgsError(f"speculative_config must be a dict like {{'method': 'ngram', "
                                  f"'num_speculative_tokens': 3}} or None, got {self.speculative_config!r}")
        check_load_format(self.load_format)
        if self.trust_remote_code:
            logger.warning("trust_remote_code=True is ignored: DeepInfer never executes code from a checkpoint")

    def _check_prefix_state_cache(self) -> None:
        """Refuse bad values of the prefix state cache's arguments, naming the argument."""
        flag = self.enable_prefix_state_cache
        if flag is not None:
            parsed = parse_flag(flag)
            if parsed is None:
                raise EngineArgsError(f"enable_prefix_state_cache must be True, False or None (on with prefix "
                                      f"caching), got {flag!r}")
            self.enable_prefix_state_cache = parsed
        if self.enable_prefix_state_cache and not self.enable_prefix_caching:
            raise EngineArgsError("enable_prefix_state_cache=True restores state at prefix-cache hits: it needs "
                                  "enable_prefix_caching=True")
        if self.prefix_state_cache_bytes is not None:
            _check_int("prefix_state_cache_bytes", self.prefix_state_cache_bytes)
            if self.enable_prefix_state_cache is False or not self.enable_prefix_caching:
                off = "enable_prefix_state_cache=False" if self.enable_prefix_state_cache is False else \
                    "enable_prefix_caching=False"
                raise EngineArgsError(f"prefix_state_cache_bytes sizes the prefix state cache, which {off} turns "
                                      "off: give one of them")
        split = self.prefix_state_split_min_tokens
        if split is not None and (isinstance(split, bool) or not isinstance(split, int) or split < 0):
            raise EngineArgsError(f"prefix_state_split_min_tokens must be an integer >= 0 (0: never split a prompt's "
                                  f"chunk), got {split!r}")

    def torch_dtype(self, device_type: str) -> torch.dtype:
        """The model dtype on a device of ``device_type`` (``"auto"``: float32 on CPU, bfloat16 elsewhere)."""
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype == "auto":
            return torch.float32 if device_type == "cpu" else torch.bfloat16
        return DTYPES[self.dtype]

    def resolve_max_model_len(self, max_positions: int) -> int:
        """``max_model_len``, or the model's ``max_positions`` when unset. Longer than the model's positions is
        refused unless ``DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN=1`` (vLLM's ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``)."""
        from deepinfer_core import envs

        if self.max_model_len is None:
            return max_positions
        if self.max_model_len > max_positions:
            beyond = (f"max_model_len={self.max_model_len} is longer than the model's max_position_embeddings="
                      f"{max_positions}")
            if not envs.DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN:
                raise EngineArgsError(f"{beyond}; lower it, or set DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN=1 to run past "
                                      "the positions the model was trained on (its outputs there may be wrong)")
            logger.warning("%s; running anyway (DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN=1)", beyond)
        return self.max_model_len

    def feature_options(self) -> Mapping[str, Any]:
        return dict(self.options)


def check_load_format(load_format: object) -> None:
    """Raise EngineArgsError for a ``load_format`` not in ``LOAD_FORMATS`` (pickle formats are refused)."""
    if load_format in LOAD_FORMATS:
        return
    pickle = " (pickle checkpoints are never loaded: convert it to safetensors)" if load_format in ("pt", "npcache") \
        else ""
    raise EngineArgsError(f"unknown load_format {load_format!r}{pickle}; use one of {list(LOAD_FORMATS)}: 'auto' or "
                          "'safetensors' reads the checkpoint's shards, 'dummy' draws random weights for timing")


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_int(name: str, value: object) -> None:
    if not _is_positive_int(value):
        raise EngineArgsError(f"{name} must be a positive integer, got {value!r}")

"""``LLM``: the offline API, compatible with vLLM's ``vllm.LLM``."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.backends.registry import select_backend
from deepinfer_core.engine.decode_graphs import DecodeGraphs, default_sizes
from deepinfer_core.engine.engine import Engine, EngineConfig, RequestRejectedError
from deepinfer_core.engine.prefill_graphs import BUCKETS, PrefillGraphs
from deepinfer_core.models.registry import default_registry
from deepinfer_core.models.resolve import resolve_model
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.plugins import configure_plugins, get_plugin_manager
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.tokenizer import Tokenizer

logger = logging.getLogger("deepinfer")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}
_CPU_DEFAULT_BUDGET = 2 * 1024**3

Prompt = str | Mapping[str, Any]


class LLM:
    """Load a DeepSeek-V4 checkpoint and generate from it, offline.

    Args:
        model: checkpoint folder, hub id in the local HF cache, or None for ``$DEEPINFER_HF_MODEL_DIR``
            or the embedded tiny default model.
        backend: backend name (``cpu``, ``nvidia_sm100``, ...); default ``$DEEPINFER_ACCELERATOR`` or automatic.
        dtype: ``"auto"`` (float32 on CPU, bfloat16 on accelerators), or a torch dtype / name.
        max_model_len: longest prompt + output in tokens (default: the model's max_position_embeddings).
        max_num_seqs: most sequences running at once. max_num_batched_tokens: token budget per step (default: the
            backend's ``default_max_num_batched_tokens``: 2048 on CPU; on NVIDIA GPUs 16384 from 70 GiB of memory
            (H100 / H200 / B200: vLLM's offline default there), else 8192).
        kv_cache_memory_bytes: bytes for the model state (paged blocks and per-sequence slots); default
            a fraction (``memory_fraction``) of free device memory, or up to 2 GiB on CPU.
        seed: base seed for requests without ``SamplingParams.seed``.
        block_size: tokens per state block (a multiple of every compression ratio).
        enable_prefix_caching: share full blocks of identical prefixes between requests.
        tokenizer: a folder with tokenizer.json to use instead of the checkpoint's.
        enforce_eager: never replay decode steps from captured graphs (as in vLLM).
        enable_mixed_chunk: decode running requests in the steps that prefill prompts too (vLLM's way; SGLang's
            ``--enable-mixed-chunk``). Off by default (SGLang's default): while prompt tokens wait, a step folds only
            those, and the running requests decode in the steps between (a decode beside a prompt chunk costs a
            second pass over the weights here: a captured decode graph beside the eager prefill). On, running
            requests never pause for a prompt.
        async_scheduling: plan and launch each step before the previous step's tokens are read, so the host's
            per-step work (stop checks, text, scheduling) overlaps the device's (vLLM's ``async_scheduling``); the
            outputs are the same. Default: the backend's ``default_async_scheduling`` (on for NVIDIA, off on CPU).
        cuda_graph_sizes: decode batch sizes to capture (vLLM's name); default ``1, 2, 4, 8, 16, 24, 32, 48, 64,
            ...`` up to ``max_num_seqs`` on a backend with graphs, none on one without (CPU). Given explicitly on
            CPU, decode steps take the same static-shape path, run eagerly.
        prefill_graph_buckets: token counts of the captured prefill steps for lone prompts (each prompt padded to
            the next; ``engine/prefill_graphs.py``); default ``512, 1024, ..., 8192`` up to
            ``max_num_batched_tokens`` wherever decode steps replay graphs, none with ``enforce_eager``; ``[]``
            turns them off.
        gpu_memory_utilization, tensor_parallel_size, trust_remote_code: vLLM's names, accepted so vLLM code
            runs: the first is ``memory_fraction``; only one device per engine for now; no remote code is ever
            executed (a checkpoint needing it is refused).
        **options: feature options claimed by plugins (e.g. ``batch_invariant=True``); an option no
            loaded plugin claims is an error.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        backend: str | None = None,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        seed: int = 0,
        block_size: int | None = None,
        enable_prefix_caching: bool = True,
        memory_fraction: float = 0.9,
        tokenizer: str | os.PathLike | None = None,
        gpu_memory_utilization: float | None = None,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        cuda_graph_sizes: Sequence[int] | None = None,
        prefill_graph_buckets: Sequence[int] | None = None,
        enable_mixed_chunk: bool = False,
        async_scheduling: bool | None = None,
        trust_remote_code: bool = False,
        **options: Any,
    ):
        _check_positive(max_num_seqs=max_num_seqs)
        if max_num_batched_tokens is not None:
            _check_positive(max_num_batched_tokens=max_num_batched_tokens)
        if prefill_graph_buckets is not None:
            bad = [n for n in prefill_graph_buckets if not isinstance(n, int) or isinstance(n, bool) or n < 1]
            if bad:
                raise ValueError(f"prefill_graph_buckets must be positive integers (token counts), got {bad}")
        if tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: this engine runs one device per engine "
                             "for now; use tensor_parallel_size=1")
        if gpu_memory_utilization is not None:
            if not 0 < gpu_memory_utilization <= 1:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
            memory_fraction = gpu_memory_utilization
        if trust_remote_code:
            logger.warning("trust_remote_code=True is ignored: DeepInfer never executes code from a checkpoint")
        self.model_dir = resolve_model(model)
        self.plugin_manager = get_plugin_manager()
        self.backend = select_backend(backend)
        _limit_host_threads(self.backend)
        self.max_num_batched_tokens = max_num_batched_tokens or self.backend.default_max_num_batched_tokens
        if async_scheduling is not None and not isinstance(async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True, False or None (the backend's default), "
                             f"got {async_scheduling!r}")
        self.async_scheduling = (self.backend.default_async_scheduling if async_scheduling is None
                                 else async_scheduling)
        registry = default_registry(self.plugin_manager)
        configure_plugins(self.plugin_manager, {"model": str(self.model_dir)}, options, self.backend.name)
        ops = self.backend.make_op_table(self.plugin_manager)
        self.dtype = _resolve_dtype(dtype, self.backend.device.type)
        self.model = registry.load(self.model_dir, ops, self.dtype, self.backend.device)
        self.tokenizer = Tokenizer.from_folder(Path(tokenizer) if tokenizer is not None else self.model_dir)
        config = self.model.config
        self.max_model_len = max_model_len or config.max_position_embeddings
        block = block_size or max(config.block_multiple, 16)
        sizes = self._graph_sizes(enforce_eager, cuda_graph_sizes, max_num_seqs)
        spare = 1 if sizes else 0  # a slot and a block the state manager never hands out: padded graph rows
        num_blocks = self._num_blocks(block, max_num_seqs + spare, kv_cache_memory_bytes, memory_fraction) - spare
        if num_blocks < 1:
            raise ValueError("the state budget holds no block beside the graphs' spare block; raise "
                             "kv_cache_memory_bytes or pass enforce_eager=True")
        state = self.model.new_state(num_slots=max_num_seqs + spare, num_blocks=num_blocks + spare, block_size=block)
        engine_config = EngineConfig(self.max_model_len, max_num_seqs, self.max_num_batched_tokens, block, num_blocks,
                                     enable_prefix_caching, seed, self.async_scheduling, enable_mixed_chunk)
        graphs = prefill = None
        if sizes:
            graphs = DecodeGraphs(self.model, state, self.backend.capture_graph, sizes, self.max_model_len,
                                  spare_slot=max_num_seqs, spare_block=num_blocks)
            buckets = BUCKETS if prefill_graph_buckets is None else tuple(prefill_graph_buckets)
            prefill = PrefillGraphs(self.model, state, self.backend.capture_graph, self.max_num_batched_tokens,
                                    max_num_seqs, num_blocks, buckets) if buckets else None
        self.engine = Engine(self.model, state, self.tokenizer, engine_config, self.plugin_manager, graphs, prefill)
        self._ids = itertools.count()

    def _graph_sizes(self, enforce_eager: bool, sizes: Sequence[int] | None, max_num_seqs: int) -> list[int]:
        if enforce_eager:
            return []
        if sizes is not None:
            bad = [n for n in sizes if not isinstance(n, int) or n < 1]
            if bad:
                raise ValueError(f"cuda_graph_sizes must be positive integers, got {bad}")
            return [n for n in sizes if n <= max_num_seqs]
        caps = self.backend.capabilities()
        return default_sizes(max_num_seqs) if caps.device_graphs else []

    def _num_blocks(self, block_size: int, num_slots: int, budget: int | None, fraction: float) -> int:
        from deepinfer_core.models.deepseek_v4.state import DeepseekV4State

        config = self.model.config
        per_block = DeepseekV4State.bytes_per_block(config, block_size, self.dtype)
        slots = num_slots * DeepseekV4State.bytes_per_slot(config, block_size, self.dtype)
        if budget is None:
            free = self.backend.memory_info().free_bytes
            wanted = slots + per_block * num_slots * -(-self.max_model_len // block_size)
            cap = _CPU_DEFAULT_BUDGET if self.backend.device.type == "cpu" else int(free * fraction)
            budget = min(wanted, cap, int(free * fraction))
        if per_block == 0:  # no paged state (sliding-window layers only): blocks only count tokens
            if budget < slots:
                raise ValueError(f"kv_cache_memory_bytes={budget} cannot hold {num_slots} sequence slots "
                                 f"({slots} bytes); raise it or lower max_num_seqs")
            return num_slots * -(-self.max_model_len // block_size)
        num_blocks = (budget - slots) // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} cannot hold {num_slots} sequence slots ({slots} bytes) plus one "
                f"{per_block}-byte state block; raise it or lower max_num_seqs")
        return int(num_blocks)

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or ``{"prompt_token_ids": [...]}``); outputs in input order.

        A prompt the engine refuses (longer than ``max_model_len``, empty, bad token ids) gets a
        ``RequestOutput`` with ``error`` set and no completions; the other prompts still run.
        """
        prompt_list = [prompts] if isinstance(prompts, (str, Mapping)) else list(prompts)
        params = _params_per_prompt(sampling_params, len(prompt_list))
        results: list[RequestOutput | None] = [None] * len(prompt_list)
        index_of: dict[str, int] = {}
        for i, (prompt, p) in enumerate(zip(prompt_list, params)):
            text, token_ids = self._tokenize(prompt)
            group_id = str(next(self._ids))
            try:
                self.engine.add_request(group_id, text, token_ids, p)
                index_of[group_id] = i
            except RequestRejectedError as exc:
                logger.warning("request %d refused: %s", i, exc)
                results[i] = RequestOutput(group_id, text, token_ids, None, [], True, error=str(exc))
        self._run(results, index_of, use_tqdm)
        return results  # type: ignore[return-value]

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts = [{"prompt_token_ids": self.tokenizer.apply_chat_template(list(c), add_generation_prompt,
                                                                            tokenize=True)} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, Mapping) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise TypeError(f"a prompt must be a string or a dict with 'prompt' or 'prompt_token_ids', got {prompt!r}")

    def _run(self, results: list[RequestOutput | None], index_of: dict[str, int], use_tqdm: bool) -> None:
        progress = None
        if use_tqdm and len(index_of) > 1:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(index_of), desc="Processed prompts", dynamic_ncols=True)
        while self.engine.has_unfinished():
            for output in self.engine.step():
                results[index_of[output.request_id]] = output
                if progress is not None:
                    progress.update(1)
        if progress is not None:
            progress.close()


def _params_per_prompt(sampling_params, count: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling_params for {count} prompts; pass one, or one per prompt")
    return params


def _resolve_dtype(dtype: str | torch.dtype, device_type: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if device_type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use 'auto', {sorted(_DTYPES)} or a torch.dtype")
    return _DTYPES[dtype]


def _limit_host_threads(backend) -> None:
    """torch's CPU threads set to ``backend.host_threads`` (a device backend's host does small bookkeeping ops,
    where a thread pool only waits on itself), unless the user chose them with ``OMP_NUM_THREADS``."""
    threads = backend.host_threads
    if threads is None or "OMP_NUM_THREADS" in os.environ or torch.get_num_threads() == threads:
        return
    logger.info("%s: torch CPU threads %d -> %d (the backend's host_threads; OMP_NUM_THREADS overrides)",
                backend.name, torch.get_num_threads(), threads)
    torch.set_num_threads(threads)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")

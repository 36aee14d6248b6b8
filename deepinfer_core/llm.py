"""``LLM``: the offline API, compatible with vLLM's ``vllm.LLM``."""

from __future__ import annotations

import itertools
import logging
import operator
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.backends.host_threads import OMP_VARIABLE
from deepinfer_core.backends.registry import choose_backend, load_backend_class
from deepinfer_core.distributed.launcher import SpawnedRanks, spawns_ranks
from deepinfer_core.distributed.worker import DataParallelWorker
from deepinfer_core.engine.decode_graphs import DecodeGraphs, default_sizes
from deepinfer_core.engine.engine import Engine, EngineConfig, RequestRejectedError
from deepinfer_core.engine.prefill_graphs import BUCKETS, PrefillGraphs
from deepinfer_core.engine.prefix_state_cache import PREFIX_STATE_SPLIT_MIN_TOKENS
from deepinfer_core.engine.verify_graphs import VerifyGraphs
from deepinfer_core.engine_args import EngineArgs, EngineArgsError
from deepinfer_core.engine_context import EngineContext
from deepinfer_core.metrics import Metric
from deepinfer_core.models.interface import SlotStateModel, StaticStepModel
from deepinfer_core.models.registry import default_registry, read_model_config
from deepinfer_core.models.resolve import resolve_model
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.plugins import check_strict, configure_plugins, get_plugin_manager, plugin_logits_processors
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.spec_decode.speculator import build_speculator
from deepinfer_core.tokenizer import Tokenizer, TokenizerError

logger = logging.getLogger("deepinfer")

_CPU_DEFAULT_BUDGET = 2 * 1024**3

Prompt = str | Mapping[str, Any]


class LLM:
    """Load a DeepSeek checkpoint and generate from it, offline (vLLM's ``vllm.LLM``).

    ``LLM(model=None, **kwargs)``: ``model`` is a checkpoint folder, a hub id in the local HF cache, or None for
    ``$DEEPINFER_HF_MODEL_DIR`` or the embedded default; every keyword is an engine argument (``EngineArgs``, with
    vLLM's names: ``max_model_len``, ``max_num_seqs``, ``enable_prefix_caching``, ``gpu_memory_utilization``, ...)
    or a feature option a plugin claims (e.g. ``batch_invariant=True``). ``logits_processors=[...]`` adds logits
    processors (``deepinfer_core.sampling.LogitsProcessor``) to those the plugins contribute.

    ``llm.context`` is the ``EngineContext`` the plugins see; ``llm.backend_choice`` says which backend runs and why.

    ``data_parallel_size=N`` (with ``enable_expert_parallel=True`` to split the routed experts) runs N ranks, each
    its own engine (docs/distributed.md): started here, or this process is one of them under torchrun. The process
    that started the ranks holds no engine or model (``llm.engine``); ``shutdown()`` stops the ranks.
    """

    def __init__(self, model: str | os.PathLike | None = None, **kwargs: Any):
        self.args = args = EngineArgs.from_kwargs(model, **kwargs)
        self.model_dir = resolve_model(args.model)
        self._parallel: SpawnedRanks | DataParallelWorker | None = None
        if spawns_ranks(args):
            self._start_ranks(model, kwargs)
            return
        self._parallel = DataParallelWorker.from_environment(args)
        self.plugin_manager = get_plugin_manager()
        check_strict(self.plugin_manager)
        self.backend_choice = choose_backend(args.backend)
        backend_class = load_backend_class(self.backend_choice.probe)
        self.backend = (backend_class() if self._parallel is None  # a backend class may take no arguments
                        else backend_class(device_index=self._parallel.info.local_rank))
        if self._parallel is not None:
            self._parallel.connect(self.backend)
        logger.info("backend %s: %s", self.backend_choice.name, self.backend_choice.why)
        _limit_host_threads(self.backend)
        self.max_num_batched_tokens = args.max_num_batched_tokens or self.backend.default_max_num_batched_tokens
        self.async_scheduling = (self.backend.default_async_scheduling if args.async_scheduling is None
                                 else args.async_scheduling)
        self.dtype = args.torch_dtype(self.backend.device.type)
        self.tokenizer = Tokenizer.from_folder(Path(args.tokenizer) if args.tokenizer is not None else self.model_dir)
        self.context = EngineContext(
            backend_name=self.backend.name, options=args.feature_options(), backend_reason=self.backend_choice.why,
            device=self.backend.device, dtype=self.dtype, model_dir=Path(self.model_dir),
            model_config=read_model_config(self.model_dir), tokenizer=self.tokenizer, args=args)
        configure_plugins(self.plugin_manager, context=self.context)
        registry = default_registry(self.plugin_manager, self.context)
        ops = self.backend.make_op_table(self.plugin_manager, self.context)
        positions = self.context.model_config.get("max_position_embeddings")
        if isinstance(positions, int):
            args.resolve_max_model_len(positions)  # refuse a too-long max_model_len before loading any weight
        self.model = registry.load(self.model_dir, ops, self.dtype, self.backend.device, args.load_format)
        if self._parallel is not None:
            self._parallel.prepare(self.model)
        self.max_model_len = args.resolve_max_model_len(self.model.max_position_embeddings)
        self.engine = self._build_engine(args)
        config = self.engine.config
        logger.info("model %s: %s, max_model_len %d, %d sequence slots, %d state blocks of %d tokens, %d tokens per "
                    "step, %s scheduling", self.model_dir, self.dtype, self.max_model_len, config.max_num_seqs,
                    config.num_blocks, config.block_size, config.max_num_batched_tokens,
                    "asynchronous" if config.async_scheduling else "synchronous")
        self._ids = itertools.count()

    def _start_ranks(self, model, kwargs: dict[str, Any]) -> None:
        """Start ``data_parallel_size`` ranks (``distributed/launcher.py``); this process keeps the tokenizer."""
        self.backend_choice = choose_backend(self.args.backend)
        self.tokenizer = Tokenizer.from_folder(Path(self.args.tokenizer) if self.args.tokenizer is not None
                                               else self.model_dir)
        self._parallel = SpawnedRanks(model, kwargs, self.args.data_parallel_size)

    def shutdown(self) -> None:
        """Stop the ranks this ``LLM`` started (nothing to do for one process)."""
        if isinstance(self._parallel, SpawnedRanks):
            self._parallel.shutdown()

    def _build_engine(self, args: EngineArgs) -> Engine:
        """Size the state for the memory budget, allocate it, and build the engine with its graphs."""
        block = args.block_size or max(self.model.block_multiple, 16)
        sizes = self._graph_sizes(args)
        spare = 1 if sizes else 0  # a slot and a block the state manager never hands out: padded graph rows
        num_slots = args.max_num_seqs
        processors = [*args.logits_processors, *plugin_logits_processors(self.plugin_manager, self.context)]
        speculator = build_speculator(args.speculative_config, self.model, self.plugin_manager, self.context,
                                      self.max_model_len, num_slots)
        draft_bytes = speculator.proposer.slot_state_bytes() if speculator is not None else 0
        keeps_state = self._keeps_prefix_state(args, speculator is not None)
        num_blocks = self._num_blocks(block, num_slots + spare, args, draft_bytes, keeps_state) - spare
        if num_blocks < 1:
            raise ValueError("the state budget holds no block beside the graphs' spare block; raise "
                             "kv_cache_memory_bytes or pass enforce_eager=True")
        state = self.model.new_state(num_slots=num_slots + spare, num_blocks=num_blocks + spare, block_size=block)
        config = EngineConfig(
            max_model_len=self.max_model_len, max_num_seqs=num_slots,
            max_num_batched_tokens=self.max_num_batched_tokens, block_size=block, num_blocks=num_blocks,
            enable_prefix_caching=args.enable_prefix_caching, seed=args.seed, async_scheduling=self.async_scheduling,
            enable_mixed_chunk=args.enable_mixed_chunk, prefix_state_cache_bytes=self.prefix_state_cache_bytes,
            prefix_state_split_min_tokens=(PREFIX_STATE_SPLIT_MIN_TOKENS if args.prefix_state_split_min_tokens is None
                                           else args.prefix_state_split_min_tokens))
        graphs = prefill = None
        if sizes:
            graphs = DecodeGraphs(self.model, state, self.backend.capture_graph, sizes, self.max_model_len,
                                  spare_slot=num_slots, spare_block=num_blocks)
            buckets = BUCKETS if args.prefill_graph_buckets is None else tuple(args.prefill_graph_buckets)
            prefill = PrefillGraphs(self.model, state, self.backend.capture_graph, self.max_num_batched_tokens,
                                    num_slots, num_blocks, buckets) if buckets else None
        engine = Engine(self.model, state, self.tokenizer, config, self.plugin_manager, graphs, prefill,
                        logits_processors=processors, context=self.context, speculator=speculator)
        if sizes and speculator is not None and VerifyGraphs.supported(self.model):
            engine.runner.verify_graphs = VerifyGraphs(
                self.model, state, self.backend.capture_graph, sizes, self.max_model_len, speculator.k + 1,
                spare_slot=num_slots, spare_block=num_blocks, return_hidden=speculator.needs_hidden_states)
        if sizes and speculator is not None:
            speculator.proposer.use_graphs(self.backend.capture_graph, sizes)
        return engine

    def _graph_sizes(self, args: EngineArgs) -> list[int]:
        """Decode batch sizes to capture: none when eager or when the model has no static steps."""
        if args.enforce_eager or not isinstance(self.model, StaticStepModel):
            return []
        if self._parallel is not None:  # a rank runs one eager forward per step, in lockstep with the others;
            return []  # graphs with expert-parallel collectives inside are for the multi-GPU work
        if args.cuda_graph_sizes is not None:
            return [n for n in args.cuda_graph_sizes if n <= args.max_num_seqs]
        caps = self.backend.capabilities()
        return default_sizes(args.max_num_seqs) if caps.device_graphs else []

    def _keeps_prefix_state(self, args: EngineArgs, speculative: bool) -> bool:
        """Whether the engine keeps sequence state at block boundaries in device memory (``EngineArgs``'
        ``enable_prefix_state_cache``): by default with prefix caching, for a ``SlotStateModel``, without speculative
        decoding (whose draft state the slot does not hold); asked for explicitly where it cannot run: an error."""
        wanted = args.enable_prefix_state_cache
        if not args.enable_prefix_caching or wanted is False:
            return False
        why = (f"the model ({type(self.model).__name__}) cannot copy its slot state (no slot_state_views)"
               if not isinstance(self.model, SlotStateModel) else
               "speculative decoding's draft state is not part of a slot" if speculative else None)
        if why is not None and (wanted or args.prefix_state_cache_bytes is not None):
            given = "enable_prefix_state_cache=True" if wanted else "prefix_state_cache_bytes"
            raise EngineArgsError(f"{given} asks for the prefix state cache, which cannot run here: {why}; leave it "
                                  "unset")
        return why is None

    def _num_blocks(self, block_size: int, num_slots: int, args: EngineArgs, draft_slot_bytes: int = 0,
                    keeps_state: bool = False) -> int:
        """Paged blocks the state budget holds beside ``num_slots`` slots; sets ``prefix_state_cache_bytes`` (0: no
        prefix state cache), taken out of a budget that comes from free device memory."""
        cost = self.model.state_bytes(block_size, self.dtype)
        slots = num_slots * (cost.per_slot + draft_slot_bytes)
        budget = args.kv_cache_memory_bytes
        self.prefix_state_cache_bytes = 0
        if budget is None:
            free = self.backend.memory_info().free_bytes
            fraction = args.gpu_memory_utilization
            wanted = slots + cost.per_block * num_slots * -(-self.max_model_len // block_size)
            cap = _CPU_DEFAULT_BUDGET if self.backend.device.type == "cpu" else int(free * fraction)
            cap = min(cap, int(free * fraction))
            if keeps_state:
                one_sequence = slots + cost.per_block * -(-self.max_model_len // block_size)
                self.prefix_state_cache_bytes = self._prefix_state_bytes(args, cost.per_slot, cap, cap - one_sequence)
            budget = min(wanted, cap - self.prefix_state_cache_bytes)
            self._check_one_full_sequence(budget, slots, cost.per_block, block_size, num_slots)
        elif keeps_state:
            self.prefix_state_cache_bytes = self._prefix_state_bytes(args, cost.per_slot, budget)
        if keeps_state:
            logger.info("prefix state cache: %.1f MiB of device memory (%d entries of %d bytes)%s",
                        self.prefix_state_cache_bytes / 2**20, self.prefix_state_cache_bytes // max(cost.per_slot, 1),
                        cost.per_slot, " beside kv_cache_memory_bytes" if args.kv_cache_memory_bytes is not None
                        else ", taken out of the state budget")
        if cost.per_block == 0:  # no paged state (sliding-window layers only): blocks only count tokens
            if budget < slots:
                raise ValueError(f"kv_cache_memory_bytes={budget} cannot hold {num_slots} sequence slots "
                                 f"({slots} bytes); raise it or lower max_num_seqs")
            return num_slots * -(-self.max_model_len // block_size)
        num_blocks = (budget - slots) // cost.per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} cannot hold {num_slots} sequence slots ({slots} bytes) plus one "
                f"{cost.per_block}-byte state block; raise it or lower max_num_seqs")
        return int(num_blocks)

    def _prefix_state_bytes(self, args: EngineArgs, per_slot: int, budget: int, room: int | None = None) -> int:
        """The prefix state cache's bytes: ``prefix_state_cache_bytes``, else 16 slot states per sequence slot, at
        most 1/8 of ``budget`` but at least one per slot, and never more than ``room`` (what the budget has beside
        one ``max_model_len`` sequence)."""
        if args.prefix_state_cache_bytes is not None:
            return args.prefix_state_cache_bytes
        per_seq = per_slot * args.max_num_seqs
        default = min(16 * per_seq, max(budget // 8, per_seq))
        return default if room is None else max(0, min(default, room))

    def _check_one_full_sequence(self, budget: int, slots: int, per_block: int, block_size: int,
                                 num_slots: int) -> None:
        """Refuse at start-up a device budget that cannot hold the slots plus one ``max_model_len`` sequence."""
        blocks = -(-self.max_model_len // block_size)
        needed = slots + per_block * blocks  # bytes
        if budget >= needed:
            return
        raise ValueError(
            f"max_model_len={self.max_model_len} needs {needed / 2**30:.2f} GiB of model state ({blocks} blocks of "
            f"{per_block} bytes, {per_block / block_size:.0f} bytes per token, plus {slots} bytes of slots for "
            f"{num_slots} sequences) but the state budget on {self.backend.device} is {budget / 2**30:.2f} GiB; "
            "lower max_model_len or max_num_seqs, raise gpu_memory_utilization, or pass kv_cache_memory_bytes")

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
        if self._parallel is not None:  # data-parallel ranks (deepinfer_core/distributed)
            prompt_list = [prompts] if isinstance(prompts, (str, Mapping)) else list(prompts)
            return self._parallel.generate(self, prompt_list, _params_per_prompt(sampling_params, len(prompt_list)))
        results, index_of = self._add_requests(prompts, sampling_params)
        self._run(results, index_of, use_tqdm)
        return results  # type: ignore[return-value]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[list[RequestOutput]]:
        """``generate`` one step at a time: after every engine step, one output per prompt in input order. A prompt
        still running has its completions' tokens and the text safe to show so far, ``finished`` False and no
        logprobs (vLLM's ``RequestOutputKind.CUMULATIVE``); the last list is what ``generate`` returns. Each step
        copies every running prompt's tokens: meant for watching a few prompts (``deepinfer generate`` on a
        terminal), not for large batches."""
        if self._parallel is not None:
            raise NotImplementedError("LLM.stream steps this process's engine; with data_parallel_size > 1 use "
                                      "generate")
        results, running = self._add_requests(prompts, sampling_params)
        if not running:  # every prompt refused
            yield results  # type: ignore[misc]
        while self.engine.has_unfinished():
            for output in self.engine.step():
                results[running.pop(output.request_id)] = output
            snapshot = list(results)
            for group_id, i in running.items():
                snapshot[i] = self.engine.partial_output(group_id)
            yield snapshot  # type: ignore[misc]

    def _add_requests(self, prompts: Prompt | Sequence[Prompt],
                      sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                      ) -> tuple[list[RequestOutput | None], dict[str, int]]:
        """Queue every prompt; returns the outputs list (refused prompts already filled in) and the prompt index of
        each queued group id."""
        prompt_list = [prompts] if isinstance(prompts, (str, Mapping)) else list(prompts)
        params = _params_per_prompt(sampling_params, len(prompt_list))
        results: list[RequestOutput | None] = [None] * len(prompt_list)
        index_of: dict[str, int] = {}
        for i, (prompt, p) in enumerate(zip(prompt_list, params)):
            group_id = str(next(self._ids))
            text, token_ids = _shown_prompt(prompt), None
            try:
                text, token_ids = self._tokenize(prompt)
                self.engine.add_request(group_id, text, token_ids, p)
                index_of[group_id] = i
            except RequestRejectedError as exc:
                logger.warning("request %d refused: %s", i, exc)
                results[i] = RequestOutput(group_id, text, token_ids, None, [], True, error=str(exc))
        return results, index_of

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

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics now (vLLM's ``LLM.get_metrics()``): ``Counter`` / ``Gauge`` / ``Vector`` copies with
        ``.name`` and ``.value``, e.g. ``deepinfer:spec_decode_num_accepted_tokens`` (docs/speculative.md)."""
        engine = getattr(self, "engine", None)
        if engine is None:
            raise EngineArgsError("get_metrics() reads one engine's metrics; a data-parallel LLM keeps them in its "
                                  "ranks (run with data_parallel_size=1)")
        return engine.metrics.snapshot()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """The prompt's text and token ids; RequestRejectedError for text that is not UTF-8 or ids that are not
        integers (1.7 is refused, never truncated)."""
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"])
        text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, Mapping) else None
        if text is None:
            raise TypeError(f"a prompt must be a string or a dict with 'prompt' or 'prompt_token_ids', got {prompt!r}")
        try:
            return text, self.tokenizer.encode(text)
        except TokenizerError as exc:
            raise RequestRejectedError(str(exc)) from None

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


def _token_ids(ids: Any) -> list[int]:
    """``ids`` as a list of ints; RequestRejectedError naming the first id that is not an integer."""
    token_ids = []
    for position, token in enumerate(ids):
        try:
            if isinstance(token, bool):
                raise TypeError
            token_ids.append(operator.index(token))  # ints and integer numpy / torch scalars, never floats
        except TypeError:
            raise RequestRejectedError(f"prompt token id {token!r} at position {position} is not an integer; "
                                       "token ids are ints") from None
    return token_ids


def _shown_prompt(prompt: Any) -> str | None:
    """The prompt text to put in a refused prompt's output, when there is one."""
    text = prompt.get("prompt") if isinstance(prompt, Mapping) else prompt
    return text if isinstance(text, str) else None


def _params_per_prompt(sampling_params, count: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling_params for {count} prompts; pass one, or one per prompt")
    return params


def _limit_host_threads(backend) -> None:
    """torch's CPU threads set to the backend's choice (``Backend.host_thread_choice``: a device backend's host does
    small bookkeeping ops; the CPU backend takes the idle cores), never above torch's current count, unless the user
    chose them with ``OMP_NUM_THREADS``."""
    choice = backend.host_thread_choice()
    if choice is None or OMP_VARIABLE in os.environ:
        return
    threads = min(choice.count, torch.get_num_threads())
    if threads == torch.get_num_threads():
        return
    logger.info("%s: torch CPU threads %d -> %d (%s)", backend.name, torch.get_num_threads(), threads, choice.why)
    torch.set_num_threads(threads)

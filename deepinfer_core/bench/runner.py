"""The offline benchmark: the engine (and optionally HF ``generate``) on the same checkpoint and prompts.

Every prompt has exactly ``input_len`` random token ids and every request generates exactly
``output_len`` tokens greedily (EOS ignored), so both sides do the same work. HF runs in the same
process after the engine has been freed, in batches of ``max_num_seqs`` prompts. Its DeepSeek-V4
compressors pool raw token windows without looking at ``attention_mask`` (and number compressed
positions from 0 per row), so left-padded batches would be wrong; equal-length prompts need no padding.

With ``json_schema``, every request is constrained to that JSON schema (``SamplingParams.structured_outputs``,
compact JSON) and ends when the grammar completes or at ``output_len`` (EOS is not ignored: a grammar ends with it);
a schema whose shortest document is longer than ``output_len`` tokens keeps the work equal to an unconstrained run. A
preset then gets a byte-level BPE tokenizer of its vocabulary size (``byte_tokenizer.py``: the word-level one cannot
spell JSON). The result's ``structured_output`` says how long the host spent on token masks and how much of it the
engine waited for.

With ``prompts_file``, the timed run's prompts are the file's first ``num_prompts`` non-empty lines (real text, one
prompt per line), tokenized and cut to ``input_len`` tokens; the warm-up keeps random prompts of the first one's
length, and the roofline still counts ``input_len`` tokens per prompt; HF is not compared (its batches take equal
lengths only). With ``speculative_config``, the engine's metrics gain ``speculative`` (drafts, acceptance).

With ``prefix_share`` F > 0, every prompt (warm-up and timed) starts with the same ``prefix_len`` =
round(F * input_len) random tokens (seeded; at most ``input_len - 1`` for F < 1), the rest random per prompt. The
warm-up's prompts put the prefix in the prefix cache, so the timed run measures prefix hits. F = 1 makes every prompt
that same prefix: each timed prompt is identical to the warm-up's (a full hit).

Per request the engine run records the time of its first token (TTFT, by stepping the engine and
watching ``output_token_ids`` after each step) and of its last; TPOT is (last - first) / (tokens - 1).
It also records the prompt tokens each request took from the prefix cache (``RequestOutput.num_cached_tokens``)
and the prompt tokens it computed (from where its latest admission started: ``Request.admitted_from``, so the
replay that rebuilds the sliding window after a hit counts as computed).
HF's times come from a logits processor that notes when each of its decoding steps starts sampling.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import math
import os
import platform
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from deepinfer_core import envs
from deepinfer_core.bench import presets
from deepinfer_core.bench.byte_tokenizer import with_byte_bpe_tokenizer
from deepinfer_core.bench.roofline import roofline
from deepinfer_core.checkpoint import plan_checkpoint
from deepinfer_core.engine.logits_preparer import PrepareStats
from deepinfer_core.engine_args import DUMMY
from deepinfer_core.errors import MissingDependencyError
from deepinfer_core.models.deepseek_v4 import random_weights
from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config
from deepinfer_core.models.resolve import resolve_model
from deepinfer_core.sampling.noise import derive_seed

Log = Callable[[str], None]
PREFIX_STREAM = 1  # derive_seed sub-stream of the common prefix (the prompts use seed, seed + 1, ...)


@dataclasses.dataclass
class BenchConfig:
    """What to benchmark: a model folder or a preset, the request shapes and the engine's sizes."""

    model: str | None = None
    preset: str | None = None
    input_len: int = 128
    output_len: int = 64
    num_prompts: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None  # None: the backend's default
    max_model_len: int | None = None  # None: input_len + output_len (the least the requests need)
    backend: str | None = None
    dtype: str = "auto"
    compare_hf: bool = False
    warmup: int = 1
    num_iters: int = 1  # the engine's timed runs; its figures are the run of median total time
    enforce_eager: bool = False
    prefill_graphs: bool = True  # lone prompts through captured prefill graphs where decode steps replay graphs
    enable_mixed_chunk: bool = False
    async_scheduling: bool | None = None  # None: the backend's default
    seed: int = 0
    load_format: str = "auto"  # EngineArgs' ("dummy": a preset's weights drawn at load time, none on disk)
    prefix_share: float = 0.0  # share of each prompt that is one common prefix, in [0, 1] (1: identical prompts)
    enable_prefix_state_cache: bool | None = None  # EngineArgs' (None: on with prefix caching)
    prefix_state_cache_bytes: int | None = None
    prefix_state_split_min_tokens: int | None = None
    cache_dir: str | None = None
    preset_overrides: Mapping[str, Any] | None = None
    options: Mapping[str, Any] | None = None  # plugin feature options (``--option NAME=VALUE``)
    json_schema: Mapping[str, Any] | None = None  # every request constrained to this JSON schema
    data_parallel_size: int = 1  # > 1: that many ranks started by LLM (``bench/parallel.py``)
    enable_expert_parallel: bool = False
    speculative_config: Mapping[str, Any] | None = None  # vLLM's dict (docs/speculative.md); None: no speculation
    prompts_file: str | None = None  # real text, one prompt per line (the first num_prompts, input_len tokens each)
    # baselines timed before speculative_config on the same prompts: "none", a method name (same k) or a config dict;
    # an empty list: none and mtp (``bench/speculative.py``); None: no comparison
    compare_speculative: Sequence[str | Mapping[str, Any]] | None = None

    @property
    def model_len(self) -> int:
        """The engine's ``max_model_len``: ``max_model_len`` where given, else what the requests need."""
        return self.max_model_len or self.input_len + self.output_len

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        for name in ("input_len", "output_len", "num_prompts", "max_num_seqs", "max_num_batched_tokens", "num_iters",
                     "data_parallel_size"):
            value = getattr(self, name)
            if name == "max_num_batched_tokens" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (isinstance(self.max_model_len, bool)
                                               or not isinstance(self.max_model_len, int)
                                               or self.max_model_len < self.input_len + self.output_len):
            raise ValueError(f"max_model_len must be an integer of at least input_len + output_len "
                             f"({self.input_len + self.output_len}), got {self.max_model_len!r}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.model is not None and self.preset is not None:
            raise ValueError("give either a model folder or a preset, not both")
        share = self.prefix_share
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
            raise ValueError(f"prefix_share must be a number in [0, 1] (the share of each prompt that is a common "
                             f"prefix; 1: every prompt the same, a full hit), got {share!r}")
        if self.json_schema is not None and not isinstance(self.json_schema, Mapping):
            raise ValueError(f"json_schema must be a JSON object (a schema), got {type(self.json_schema).__name__}")
        if self.json_schema is not None and self.data_parallel_size > 1:
            raise ValueError("--json-schema runs on one engine; leave out --data-parallel-size")
        if self.speculative_config is not None and not isinstance(self.speculative_config, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(self.speculative_config).__name__}")
        if self.speculative_config is not None and self.data_parallel_size > 1:
            raise ValueError("--speculative-config runs on one engine; leave out --data-parallel-size")
        if self.compare_speculative is not None and self.speculative_config is None:
            raise ValueError("--compare-speculative compares the --speculative-config run with baselines; give "
                             """--speculative-config (e.g. '{"method": "dspark", "num_speculative_tokens": 5}')""")
        if self.compare_speculative is not None:
            from deepinfer_core.bench.speculative import check_configs, comparison_runs

            check_configs(comparison_runs(self.speculative_config, self.compare_speculative))  # before any work
        if self.prompts_file is not None and (self.num_iters > 1 or self.prefix_share or self.compare_hf):
            raise ValueError("--prompts times one run of the file's prompts (a second would hit the first's prefix "
                             "cache), has no common prefix, and HF's batches here take equal lengths only: leave out "
                             "--num-iters, --prefix-share and --compare-hf")
        if self.load_format == DUMMY and (self.compare_hf or self.seed != 0):
            raise ValueError("load_format 'dummy' draws the weights of seed 0 in the engine (HF transformers would "
                             "read a checkpoint): leave out --compare-hf and --seed")
        if self.json_schema is not None and self.compare_hf:
            raise ValueError("--json-schema constrains the engine's requests only; HF generate would not do the same "
                             "work: leave out --compare-hf")

    @property
    def prefix_len(self) -> int:
        """Tokens of the common prefix: round(prefix_share * input_len), leaving each prompt one token of its own below
        a share of 1 (at 1: the whole prompt)."""
        if self.prefix_share == 1:
            return self.input_len
        return min(round(self.prefix_share * self.input_len), self.input_len - 1)


@dataclasses.dataclass
class RunTimes:
    """Host clock readings of one timed run: start, and per request its first and last token; the garbage
    collections Python ran meanwhile."""

    start: float
    first_token: dict[str, float] = dataclasses.field(default_factory=dict)
    finished: dict[str, float] = dataclasses.field(default_factory=dict)
    outputs: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    cached_tokens: dict[str, int] = dataclasses.field(default_factory=dict)  # prompt tokens from the prefix cache
    computed_prompt_tokens: dict[str, int] = dataclasses.field(default_factory=dict)  # prompt tokens computed
    steps: int = 0
    step_ends: list[float] = dataclasses.field(default_factory=list)  # the host clock as each engine step returned
    gc_pauses: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (generation, seconds)

    def first_token_s(self) -> float:
        """Seconds from the start to the run's first token (any request's), 0 before there is one."""
        return min(self.first_token.values(), default=self.start) - self.start


@contextlib.contextmanager
def recording_gc_pauses(into: list[tuple[int, float]]) -> Iterator[None]:
    """Append ``(generation, seconds)`` for every garbage collection Python runs inside the block."""
    started: list[float] = []

    def note(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            into.append((info["generation"], time.perf_counter() - started.pop()))

    gc.callbacks.append(note)
    try:
        yield
    finally:
        gc.callbacks.remove(note)


# ------------------------------------------------------------------------------------------------ driver
def run_bench(config: BenchConfig, log: Log = lambda msg: None) -> dict[str, Any]:
    """Run the benchmark described by ``config``; returns the result dict (see ``result_keys``)."""
    config.validate()
    if config.compare_hf:
        hf_model_class()  # before any work: a missing transformers fails now, not after the engine's run
    folder = model_folder(config, log)
    model_config = DeepseekV4Config.from_file(folder / "config.json")
    quantized = stored_quantization(folder, model_config, config.load_format)  # the roofline counts their bytes
    if quantized and config.compare_hf:
        raise ValueError(f"--compare-hf needs a bf16 / fp32 checkpoint; {folder} is quantized (fp8 / fp4), which "
                         "HF transformers does not read in this format: compare on the unquantized preset")
    prefix = common_prefix(config.prefix_len, model_config.vocab_size, config.seed)
    prompts = random_prompts(config.num_prompts, config.input_len, model_config.vocab_size, config.seed, prefix)
    if config.prompts_file is not None:
        prompts = file_prompts(config.prompts_file, folder, config.num_prompts, config.input_len)
    comparison = None
    if config.compare_speculative is not None:
        engine, device, dtype, comparison = run_comparison(folder, config, prompts, log)
    elif config.data_parallel_size > 1:
        from deepinfer_core.bench.parallel import run_engine_ranks

        engine, device, dtype = run_engine_ranks(folder, config, prompts, model_config.vocab_size, log)
    else:
        engine, device, dtype = run_engine(folder, config, prompts, log)
    result: dict[str, Any] = {"config": describe(config, folder, device, dtype), "engine": engine["metrics"]}
    result["speculative_comparison"] = comparison
    result["config"]["decode_graph_replays"] = engine["graph_replays"]["decode"]
    result["config"]["prefill_graph_replays"] = engine["graph_replays"]["prefill"]
    result["config"]["max_num_batched_tokens"] = engine["max_num_batched_tokens"]  # the backend's default if unset
    result["config"]["max_model_len"] = engine.get("max_model_len", config.model_len)  # as the engine resolved it
    result["config"]["async_scheduling"] = engine["async_scheduling"]
    result["config"]["op_sources"] = engine["op_sources"]
    result["config"]["speculative_config"] = engine.get("speculative_config", config.speculative_config)  # as run
    result["structured_output"] = engine.get("structured_output")  # None without a JSON schema
    result["roofline"] = {"engine": _roofline(model_config, dtype, device, engine["metrics"], config, quantized)}
    result["hf"] = result["ratio"] = result["agreement"] = None
    if config.compare_hf:
        hf = run_hf(folder, config, prompts, device, dtype, log)
        result["hf"] = hf["metrics"]
        result["roofline"]["hf"] = _roofline(model_config, dtype, device, hf["metrics"], config, quantized)
        result["ratio"] = ratios(engine["metrics"], hf["metrics"])
        result["agreement"] = agreement(engine["outputs"], hf["outputs"])
    return result


def result_keys() -> dict[str, list[str]]:
    """The keys a result dict and its metric dicts carry (tests and JSON consumers rely on them)."""
    return {
        "result": ["config", "engine", "hf", "ratio", "agreement", "roofline", "structured_output",
                   "speculative_comparison"],
        "metrics": ["total_time_s", "num_requests", "prompt_tokens", "output_tokens", "output_throughput",
                    "total_throughput", "requests_per_s", "ttft_s", "tpot_s", "latency_s", "load_time_s", "steps",
                    "step_times_s", "iteration_total_times_s", "iteration_first_token_s", "gc_pauses",
                    "num_cached_tokens", "computed_prompt_tokens", "ttft_hit_s", "ttft_miss_s", "engine_metrics",
                    "ranks", "speculative"],
    }


def model_folder(config: BenchConfig, log: Log) -> Path:
    """The checkpoint to run: the preset's cache folder (written if needed), the model folder, or the default."""
    if config.preset is None:
        return resolve_model(config.model)
    dummy = config.load_format == DUMMY
    log(f"preparing preset {config.preset!r} ({'config only: weights drawn at load' if dummy else 'random weights'}, "
        "cached) ...")
    folder = presets.ensure_preset(config.preset, config.cache_dir, config.preset_overrides, seed=config.seed,
                                   weights=not dummy)
    if config.json_schema is not None:  # the word-level tokenizer cannot spell JSON
        log("a byte-level BPE tokenizer of the preset's vocabulary for the JSON schema (written once) ...")
        vocab_size = DeepseekV4Config.from_file(folder / "config.json").vocab_size
        folder = with_byte_bpe_tokenizer(folder, vocab_size)
    log(f"preset checkpoint: {folder}")
    return folder


def stored_quantization(folder: Path, model_config: DeepseekV4Config, load_format: str) -> dict[str, Any]:
    """The quantized weights the engine holds (canonical name -> ``QuantizedTensor``): the checkpoint's, or with
    ``load_format="dummy"`` what the loader quantizes."""
    if load_format == DUMMY:
        return random_weights.dummy_quantization(model_config)[1]
    return plan_checkpoint(folder, model_config).quantized


def prefix_state_args(config: BenchConfig) -> dict[str, Any]:
    """The prefix state cache's engine arguments the run sets (the others keep ``EngineArgs``' defaults)."""
    names = ("enable_prefix_state_cache", "prefix_state_cache_bytes", "prefix_state_split_min_tokens")
    return {name: getattr(config, name) for name in names if getattr(config, name) is not None}


def random_prompts(count: int, length: int, vocab_size: int, seed: int,
                   prefix: Sequence[int] = ()) -> list[list[int]]:
    """``count`` prompts of exactly ``length`` token ids: ``prefix``, then random ids in ``[0, vocab_size)``."""
    gen = torch.Generator().manual_seed(seed)
    tails = torch.randint(0, vocab_size, (count, length - len(prefix)), generator=gen).tolist()
    return [list(prefix) + tail for tail in tails]


def file_prompts(path: str, folder: Path, count: int, length: int) -> list[list[int]]:
    """The first ``count`` non-empty lines of the text file ``path``, each tokenized by ``folder``'s tokenizer and cut
    to its first ``length`` tokens; ValueError naming the file when it cannot be read or has too few lines."""
    from deepinfer_core.tokenizer import Tokenizer

    try:
        lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--prompts {path}: cannot read it as UTF-8 text ({exc})") from None
    if len(lines) < count:
        raise ValueError(f"--prompts {path} has {len(lines)} non-empty lines, --num-prompts asks for {count}; "
                         "lower --num-prompts or add lines (one prompt per line)")
    tokenizer = Tokenizer.from_folder(folder)
    return [tokenizer.encode(line)[:length] for line in lines[:count]]


def common_prefix(length: int, vocab_size: int, seed: int) -> list[int]:
    """The ``length`` random token ids every prompt of a run starts with (a seed stream apart from the prompts')."""
    gen = torch.Generator().manual_seed(derive_seed(seed, PREFIX_STREAM) % 2**63)
    return torch.randint(0, vocab_size, (length,), generator=gen).tolist()


def describe(config: BenchConfig, folder: Path, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The run's settings and machine, for the JSON file and the table header."""
    fields = dataclasses.asdict(config)
    fields["preset_overrides"] = dict(config.preset_overrides or {}) or None
    fields["prefix_len"] = config.prefix_len
    return {
        **fields,
        "model_folder": str(folder),
        "device": _device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "environment": envs.settings(),
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} ({platform.processor() or platform.machine()})"


def _roofline(model_config, dtype, device, metrics: Mapping[str, Any], config: BenchConfig, quantized):
    """The run's roofline; with a prefix share the prefill floor counts the prompt tokens the side computed."""
    prefill_tokens = metrics["computed_prompt_tokens"] if config.prefix_share else None
    return roofline(model_config, dtype, device, metrics["total_time_s"], config.num_prompts, config.input_len,
                    config.output_len, min(config.max_num_seqs, config.num_prompts), quantized, prefill_tokens)


# ------------------------------------------------------------------------------------------------ engine
def run_comparison(folder: Path, config: BenchConfig, prompts: Sequence[Sequence[int]],
                   log: Log) -> tuple[dict[str, Any], torch.device, torch.dtype, dict[str, Any]]:
    """``--compare-speculative``: one engine run per baseline, then the ``speculative_config`` run (whose figures
    are the result's ``engine``), all on ``prompts``; returns that run, its device and dtype, and the comparison."""
    from deepinfer_core.bench import speculative

    rows = []
    for name, spec in speculative.comparison_runs(config.speculative_config, config.compare_speculative):
        log(f"speculative comparison: {name} ...")
        engine, device, dtype = run_engine(folder, dataclasses.replace(config, speculative_config=spec), prompts, log)
        rows.append(speculative.comparison_row(name, spec, engine["metrics"], engine["outputs"]))
    return engine, device, dtype, speculative.finish_rows(rows)


def run_engine(folder: Path, config: BenchConfig, prompts: Sequence[Sequence[int]],
               log: Log) -> tuple[dict[str, Any], torch.device, torch.dtype]:
    """Load ``folder`` into ``LLM``, warm up, time ``config.num_iters`` runs (figures: the run of median total time,
    outputs: the first run's); the engine is freed before returning."""
    from deepinfer_core.llm import LLM

    log("loading the engine ...")
    t0 = time.perf_counter()
    llm = LLM(folder, backend=config.backend, dtype=config.dtype, max_model_len=config.model_len,
              max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens, seed=config.seed,
              enforce_eager=config.enforce_eager, enable_mixed_chunk=config.enable_mixed_chunk,
              prefill_graph_buckets=None if config.prefill_graphs else [],
              async_scheduling=config.async_scheduling, speculative_config=config.speculative_config,
              load_format=config.load_format, **prefix_state_args(config), **dict(config.options or {}))
    load_time = time.perf_counter() - t0
    device, dtype = llm.backend.device, llm.dtype
    prefix = prompts[0][:config.prefix_len]
    warm = random_prompts(len(prompts), len(prompts[0]), llm.model.vocab_size, config.seed + 1, prefix)
    params = request_params(config)
    for i in range(config.warmup):
        log(f"engine warmup {i + 1}/{config.warmup} ...")
        time_engine(llm, warm, config.output_len, f"warmup{i}", params)  # the timed run's shape: its graphs
    runs, masks = [], []
    before = {metric.name: metric.value for metric in llm.engine.metrics.snapshot()}
    for i in range(config.num_iters):  # run 0 takes the prompts HF gets; later runs fresh ones (hits: the prefix)
        log(f"engine: timed run {i + 1}/{config.num_iters} ...")
        run_prompts = prompts if i == 0 else random_prompts(len(prompts), len(prompts[0]),
                                                            llm.model.vocab_size, config.seed + 1 + i, prefix)
        llm.engine.preparer.stats = PrepareStats()
        runs.append(time_engine(llm, run_prompts, config.output_len, f"bench{i or ''}", params))
        masks.append(mask_figures(llm.engine.preparer.stats))
    totals = [max(run.finished.values()) - run.start for run in runs]
    median = sorted(range(len(runs)), key=totals.__getitem__)[len(runs) // 2]
    metrics = summarize(runs[median], [len(p) for p in prompts], load_time, totals,
                        [run.first_token_s() for run in runs])
    replays = {name: graphs.num_replays if graphs is not None else 0  # warmup included
               for name, graphs in (("decode", llm.engine.runner.decode_graphs),
                                    ("prefill", llm.engine.runner.prefill_graphs))}
    metrics["engine_metrics"] = {metric.name: metric.value for metric in llm.engine.metrics.snapshot()}
    metrics["speculative"] = speculation_figures(before, metrics["engine_metrics"], sum(run.steps for run in runs))
    outputs = [runs[0].outputs[f"bench-{i}"] for i in range(len(prompts))]
    budget, overlapped, model_len = llm.max_num_batched_tokens, llm.async_scheduling, llm.max_model_len
    op_sources = llm.model.ops.sources()  # which implementation each op ran (backend, plugin or reference)
    speculator = llm.engine.speculator  # None without speculation; DEEPINFER_USE_NEXTN_DECODE's config included
    spec = (None if speculator is None else {"method": speculator.config.method,
                                             "num_speculative_tokens": speculator.config.num_speculative_tokens,
                                             **speculator.config.options})
    llm.engine.shutdown()
    del llm
    _free(device)
    return {"metrics": metrics, "outputs": outputs, "graph_replays": replays, "max_num_batched_tokens": budget,
            "max_model_len": model_len, "async_scheduling": overlapped, "op_sources": op_sources, "speculative_config": spec,
            "structured_output": masks[median] if config.json_schema is not None else None}, device, dtype


def speculation_figures(before: Mapping[str, Any], after: Mapping[str, Any], steps: int) -> dict[str, Any] | None:
    """The timed runs' speculative decoding (the ``deepinfer:spec_decode_*`` counters' growth over them): drafts,
    draft / verified / accepted tokens, accepted tokens per draft position, acceptance length (1 + accepted /
    drafts), verified tokens per draft round (per sequence per step: DSpark's figure, k for fixed-k MTP) and per
    engine step (across the batch); None without speculation."""
    prefix = "deepinfer:spec_decode_"
    if f"{prefix}num_drafts" not in after:
        return None
    grown = {key: after[prefix + key] - before.get(prefix + key, 0)
             for key in ("num_drafts", "num_draft_tokens", "num_verified_tokens", "num_accepted_tokens")}
    per_pos = [a - b for a, b in zip(after[f"{prefix}num_accepted_tokens_per_pos"],
                                     before.get(f"{prefix}num_accepted_tokens_per_pos") or [0] * 64)]
    drafts = grown["num_drafts"]
    return {**grown, "accepted_per_pos": per_pos,
            "acceptance_length": 1 + grown["num_accepted_tokens"] / drafts if drafts else None,
            "verified_per_draft": grown["num_verified_tokens"] / drafts if drafts else None,
            "verified_per_step": grown["num_verified_tokens"] / steps if steps else None}


def request_params(config: BenchConfig):
    """Every request's ``SamplingParams``: greedy, ``output_len`` tokens, EOS ignored; with a JSON schema, constrained
    to it (compact) and ending with the grammar."""
    from deepinfer_core.sampling.params import SamplingParams
    from deepinfer_core.sampling.structured_outputs import StructuredOutputsParams

    if config.json_schema is None:
        return SamplingParams(temperature=0.0, max_tokens=config.output_len, ignore_eos=True)
    constraint = StructuredOutputsParams(json=dict(config.json_schema), disable_any_whitespace=True)
    return SamplingParams(temperature=0.0, max_tokens=config.output_len, structured_outputs=constraint)


def mask_figures(stats: PrepareStats) -> dict[str, Any]:
    """A run's token-mask figures: host seconds on the worker thread, of which the engine waited, per row."""
    return {"prepare_s": stats.prepare_s, "wait_s": stats.wait_s, "rows": stats.num_rows,
            "steps": stats.num_prepares, "mask_us_per_row": 1e6 * stats.prepare_s / max(stats.num_rows, 1),
            "hidden_share": stats.hidden_share}


def time_engine(llm, prompts: Sequence[Sequence[int]], output_len: int, tag: str, params=None) -> RunTimes:
    """Add every prompt at once, then step the engine to the end, noting each request's first and last token
    (``params``: default greedy, ``output_len`` tokens, EOS ignored)."""
    from deepinfer_core.sampling.params import SamplingParams

    params = params or SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine = llm.engine
    times = RunTimes(start=time.perf_counter())
    with recording_gc_pauses(times.gc_pauses):
        _step_to_the_end(engine, prompts, params, tag, times)
    return times


def _step_to_the_end(engine, prompts: Sequence[Sequence[int]], params, tag: str, times: RunTimes) -> None:
    first_request = {}
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", None, list(ids), params)
        first_request[f"{tag}-{i}"] = engine.groups[f"{tag}-{i}"][0]
    while engine.has_unfinished():
        finished = engine.step()
        now = time.perf_counter()
        times.steps += 1
        times.step_ends.append(now)
        for group_id, requests in engine.groups.items():
            if group_id not in times.first_token and any(r.output_token_ids for r in requests):
                times.first_token[group_id] = now
        for output in finished:  # a group that finished this step has left engine.groups
            times.first_token.setdefault(output.request_id, now)
            times.finished[output.request_id] = now
            times.outputs[output.request_id] = list(output.outputs[0].token_ids)
            _note_prompt_work(times, output, first_request[output.request_id])


def _note_prompt_work(times: RunTimes, output, request) -> None:
    """A finished request's prompt tokens from the prefix cache, and those it computed from where its latest admission
    started (the replay before a hit included)."""
    prompt_len = len(output.prompt_token_ids)
    times.cached_tokens[output.request_id] = output.num_cached_tokens
    times.computed_prompt_tokens[output.request_id] = max(prompt_len - request.admitted_from, 0)


# ------------------------------------------------------------------------------------------------ HF
def run_hf(folder: Path, config: BenchConfig, prompts: Sequence[Sequence[int]], device: torch.device,
           dtype: torch.dtype, log: Log) -> dict[str, Any]:
    """Load ``folder`` with HF transformers and time greedy ``generate`` in batches of ``max_num_seqs``."""
    log("loading HF transformers ...")
    t0 = time.perf_counter()
    model = _load_hf(hf_model_class(), folder, dtype, device)
    load_time = time.perf_counter() - t0
    batch = min(config.max_num_seqs, len(prompts))
    warm = random_prompts(len(prompts), len(prompts[0]), model.config.vocab_size, config.seed + 1,
                          prompts[0][:config.prefix_len])
    for i in range(config.warmup):
        log(f"HF warmup {i + 1}/{config.warmup} ...")
        time_hf(model, warm, min(config.output_len, 4), batch, device)
    log("HF: timed run ...")
    times = time_hf(model, prompts, config.output_len, batch, device)
    metrics = summarize(times, [len(p) for p in prompts], load_time)
    outputs = [times.outputs[str(i)] for i in range(len(prompts))]
    del model
    _free(device)
    return {"metrics": metrics, "outputs": outputs}


def hf_model_class() -> type:
    """HF transformers' ``DeepseekV4ForCausalLM``; MissingDependencyError naming the install command when this
    environment's transformers lacks it (or there is none)."""
    try:
        from transformers import DeepseekV4ForCausalLM
    except ImportError as exc:
        raise MissingDependencyError(f"--compare-hf needs HF transformers with DeepSeek-V4 ({exc}); install it with "
                                     "pip install 'transformers==5.23.*', or leave out --compare-hf") from None
    return DeepseekV4ForCausalLM


def _load_hf(model_class, folder: Path, dtype: torch.dtype, device: torch.device):
    """``from_pretrained`` straight onto ``device`` where transformers can, else load on the host and move."""
    if device.type != "cpu":
        try:
            return model_class.from_pretrained(folder, dtype=dtype, device_map=str(device)).eval()
        except (ImportError, ValueError):  # device_map needing accelerate
            pass
    return model_class.from_pretrained(folder, dtype=dtype).to(device).eval()


class _StepClock:
    """A logits processor that records when each decoding step reaches sampling (scores unchanged)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        return scores


def time_hf(model, prompts: Sequence[Sequence[int]], output_len: int, batch: int, device: torch.device) -> RunTimes:
    """Greedy ``generate`` of exactly ``output_len`` tokens per prompt, ``batch`` prompts at a time (no padding)."""
    from transformers import GenerationConfig, LogitsProcessorList

    gen_config = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                                  eos_token_id=None, pad_token_id=0, use_cache=True)
    times = RunTimes(start=time.perf_counter())
    for start in range(0, len(prompts), batch):
        chunk = torch.tensor([list(p) for p in prompts[start:start + batch]], device=device)
        clock = _StepClock(device)
        with torch.inference_mode(), recording_gc_pauses(times.gc_pauses):
            out = model.generate(chunk, attention_mask=torch.ones_like(chunk), generation_config=gen_config,
                                 logits_processor=LogitsProcessorList([clock]))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        times.steps += len(clock.times)
        for row in range(chunk.shape[0]):
            key = str(start + row)
            times.first_token[key] = clock.times[0]
            times.finished[key] = now
            times.outputs[key] = out[row, chunk.shape[1]:].tolist()
    return times


# ------------------------------------------------------------------------------------------------ metrics
def summarize(times: RunTimes, prompt_lens: Sequence[int], load_time: float,
              iteration_totals: Sequence[float] | None = None,
              iteration_first_tokens: Sequence[float] | None = None) -> dict[str, Any]:
    """Throughputs, per-request latency statistics, prefix-cache use and Python's collections of one timed run
    (``iteration_totals`` / ``iteration_first_tokens``: the total time / first token of every timed run it was picked
    from, default its own). A side that records no prefix-cache use (HF) took none and computed every prompt token."""
    keys = sorted(times.finished)
    total = max(times.finished.values()) - times.start
    out_tokens = sum(len(times.outputs[k]) for k in keys)
    ttft = [times.first_token[k] - times.start for k in keys]
    tpot = [(times.finished[k] - times.first_token[k]) / (len(times.outputs[k]) - 1)
            for k in keys if len(times.outputs[k]) > 1]
    latency = [times.finished[k] - times.start for k in keys]
    return {
        "total_time_s": total, "num_requests": len(keys), "prompt_tokens": sum(prompt_lens),
        "output_tokens": out_tokens, "output_throughput": out_tokens / total,
        "total_throughput": (out_tokens + sum(prompt_lens)) / total, "requests_per_s": len(keys) / total,
        "ttft_s": stats(ttft), "tpot_s": stats(tpot), "latency_s": stats(latency), "load_time_s": load_time,
        "steps": times.steps, "step_times_s": _intervals(times.start, times.step_ends),
        "iteration_total_times_s": list(iteration_totals or [total]),
        "iteration_first_token_s": list(iteration_first_tokens or [times.first_token_s()]),
        "gc_pauses": {"count": len(times.gc_pauses), "total_s": sum(s for _, s in times.gc_pauses),
                      "max_s": max((s for _, s in times.gc_pauses), default=0.0),
                      "full": sum(1 for generation, _ in times.gc_pauses if generation == 2)},
        "num_cached_tokens": stats([times.cached_tokens.get(k, 0) for k in keys]),
        "computed_prompt_tokens": (sum(times.computed_prompt_tokens.values()) if times.computed_prompt_tokens
                                   else sum(prompt_lens)),
        # TTFT of the requests that took prompt tokens from the prefix cache, and of those that took none
        "ttft_hit_s": stats([t for k, t in zip(keys, ttft) if times.cached_tokens.get(k, 0) > 0]),
        "ttft_miss_s": stats([t for k, t in zip(keys, ttft) if times.cached_tokens.get(k, 0) == 0]),
        "engine_metrics": {},  # the engine's metrics by name (LLM.get_metrics(); EPLB: moe_lb), filled by its run
        "ranks": None,  # each rank's statistics with data parallelism (``bench/parallel.py``)
        "speculative": None,  # the timed runs' draft figures with speculative decoding (``speculation_figures``)
    }


def _intervals(start: float, ends: Sequence[float]) -> list[float]:
    """Seconds each step took from the one before (the first from the run's start); empty where steps were not
    timed one by one (HF's ``generate``)."""
    return [end - before for before, end in zip([start, *ends], ends)]


def stats(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, median, p99 (nearest rank), min and max; None everywhere for no values."""
    if not values:
        return {"mean": None, "p50": None, "p99": None, "min": None, "max": None}
    ordered = sorted(values)
    return {"mean": sum(ordered) / len(ordered), "p50": _percentile(ordered, 50), "p99": _percentile(ordered, 99),
            "min": ordered[0], "max": ordered[-1]}


def _percentile(ordered: Sequence[float], pct: float) -> float:
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def ratios(engine: Mapping[str, Any], hf: Mapping[str, Any]) -> dict[str, float | None]:
    """Engine over HF: throughput ratios (> 1 means the engine is faster) and latency speed-ups."""
    def speedup(key: str) -> float | None:
        e, h = engine[key]["mean"], hf[key]["mean"]
        return h / e if e and h is not None else None

    return {
        "output_throughput": engine["output_throughput"] / hf["output_throughput"],
        "total_throughput": engine["total_throughput"] / hf["total_throughput"],
        "ttft_speedup": speedup("ttft_s"), "tpot_speedup": speedup("tpot_s"),
    }


def agreement(engine: Sequence[Sequence[int]], hf: Sequence[Sequence[int]]) -> dict[str, float | int]:
    """How far the engine's greedy outputs agree with HF's: identical requests and mean common-prefix share."""
    identical = sum(list(e) == list(h) for e, h in zip(engine, hf, strict=True))
    prefix = [_common_prefix(e, h) / max(len(h), 1) for e, h in zip(engine, hf, strict=True)]
    return {"identical_requests": identical, "num_requests": len(hf), "mean_prefix_fraction": sum(prefix) / len(hf)}


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

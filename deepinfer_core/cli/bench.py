"""``deepinfer bench``: offline throughput and latency of the engine, optionally against HF ``generate``.

Examples::

    deepinfer bench --preset tiny --input-len 128 --output-len 64 --num-prompts 16 --max-num-seqs 16 --compare-hf
    deepinfer bench --model /path/to/checkpoint --json result.json
    deepinfer bench --preset tiny --input-len 512 --prefix-share 0.75 --option enable_swa_replay=true
    deepinfer bench --preset tiny --json-schema schema.json --async-scheduling   # structured output
    deepinfer bench --preset v4-flash-8l64e --input-len 1024 --output-len 128 --num-prompts 64   # GPU only
    deepinfer bench --prompts code.txt --speculative-config '{"method": "dspark", "num_speculative_tokens": 5}' \
        --compare-speculative none mtp   # one table: no speculation, fixed-k MTP, DSpark
    deepinfer bench --preset tiny --data-parallel-size 2 --enable-expert-parallel --option enable_eplb=true \
        --option eplb_config='{"num_redundant_experts": 2, "window_size": 8, "step_interval": 8}'
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from deepinfer_core.cli.options import add_option_argument, parse_options

HELP = "benchmark offline throughput and latency (optionally against HF transformers)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``deepinfer bench`` options."""
    from deepinfer_core.bench.presets import PRESETS
    from deepinfer_core.engine_args import LOAD_FORMATS

    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="checkpoint folder or cached hub id (default: the embedded default model)")
    source.add_argument("--preset", choices=sorted(PRESETS),
                        help="random-weight checkpoint of a named shape, written once to a cache folder")
    parser.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                        help="dummy: a preset's folder holds config.json and the tokenizer only and the engine draws "
                             "its weights (the same values, seed 0) at load time: nothing written to disk, e.g. for "
                             "v4-flash-20l-fp4 (default auto: the checkpoint's shards)")
    parser.add_argument("--cache-dir", help="where presets are written (default $DEEPINFER_BENCH_CACHE or "
                                            "~/.cache/deepinfer/bench)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default 128)")
    parser.add_argument("--output-len", type=int, default=64, help="generated tokens per request (default 64)")
    parser.add_argument("--num-prompts", type=int, default=16, help="requests (default 16)")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="engine batch; HF batch size too (default 16)")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        help="engine token budget per step (default: the backend's, 2048 on CPU, 8192 on NVIDIA)")
    parser.add_argument("--max-model-len", type=int,
                        help="the engine's context length (default: --input-len + --output-len); a longer one, e.g. "
                             "the model's whole range, pads decode graphs to coarser context buckets as serving does")
    parser.add_argument("--backend", help="engine backend (default: automatic)")
    parser.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on accelerators), "
                                                        "float32, bfloat16, float16")
    parser.add_argument("--compare-hf", action="store_true",
                        help="also time HF transformers DeepseekV4ForCausalLM.generate (greedy) in this process")
    parser.add_argument("--warmup", type=int, default=1, help="warmup runs before timing, each side (default 1)")
    parser.add_argument("--num-iters", type=int, default=1,
                        help="timed engine runs, each on fresh prompts; the figures are the run of median total time "
                             "(default 1; HF is timed once)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="never replay decode steps from captured graphs (A/B against graphs)")
    parser.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="prefill a lone prompt through a graph captured per token bucket (default on where "
                             "decode steps replay graphs; --no-prefill-graphs: eager prefill steps)")
    parser.add_argument("--enable-mixed-chunk", action="store_true",
                        help="decode running requests in prefill steps too (default: they wait while prompts fold)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="launch each step before reading the last one's tokens (default: the backend's, "
                             "on for NVIDIA, off on CPU)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and preset weights (default 0)")
    parser.add_argument("--prefix-share", type=float, default=0.0, metavar="F",
                        help="share of each prompt (0 <= F <= 1) that is one common random prefix; the warm-up "
                             "caches it, so the timed run measures prefix hits (default 0: no common prefix; 1: every "
                             "prompt identical to the warm-up's, a full hit)")
    parser.add_argument("--enable-prefix-state-cache", action=argparse.BooleanOptionalAction, default=None,
                        help="keep sequence state at block boundaries in device memory so prefix hits restore it "
                             "(default: on with prefix caching; --no-enable-prefix-state-cache: the exact rebuild)")
    parser.add_argument("--prefix-state-cache-bytes", type=int, metavar="N",
                        help="device memory for the prefix state cache (default: 16 slot states per sequence, at most "
                             "1/8 of the state budget)")
    parser.add_argument("--prefix-state-split-min-tokens", type=int, metavar="N",
                        help="a prompt chunk of at least N tokens ends one token before the prompt's end so the same "
                             "prompt again is restored there and computes only its last token (a miss pays one decode "
                             "step; default 4096; 0: never)")
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="ranks, each its own engine on a share of the prompts, started by the engine (default 1; "
                             "per-request and per-step times are not seen across ranks); see docs/distributed.md")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="split the routed experts across the data-parallel ranks (needed by "
                             "--option enable_eplb=true, whose moe_lb the report shows)")
    parser.add_argument("--json-schema", metavar="FILE",
                        help="constrain every request to the JSON schema in FILE (structured output; a request ends "
                             "when the grammar completes or at --output-len; a preset gets a byte-level tokenizer)")
    parser.add_argument("--prompts", metavar="FILE",
                        help="real text instead of random tokens: the first --num-prompts non-empty lines of FILE, "
                             "one prompt per line, each cut to --input-len tokens")
    parser.add_argument("--speculative-config", metavar="JSON",
                        help="""speculative decoding, vLLM's dict as JSON, e.g. '{"method": "ngram", """
                             """"num_speculative_tokens": 3}'; the report adds acceptance length and verified tokens """
                             "per step (docs/speculative.md)")
    parser.add_argument("--compare-speculative", nargs="*", metavar="BASELINE",
                        help="also time baselines in this process on the same prompts, before the "
                             "--speculative-config run, and print one table (output tok/s, speedup over no "
                             "speculation, acceptance length, verified tokens per step, draft tokens): each BASELINE "
                             "is none, a method name (run with the same num_speculative_tokens) or a "
                             "speculative_config JSON object; no BASELINE: none mtp")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                        help="batch-invariant mode (the deepinfer-batch-invariant plugin's option batch_invariant: the "
                             "same switch as DEEPINFER_BATCH_INVARIANT=1; --no-batch-invariant turns it off whatever the "
                             "variable says)")
    add_option_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print the table (and write JSON). Exit 2 for bad arguments, 1 if it fails."""
    from deepinfer_core.bench.presets import PresetError
    from deepinfer_core.bench.report import format_report
    from deepinfer_core.bench.runner import BenchConfig, run_bench
    from deepinfer_core.cli.plugin_failures import report_plugin_failures
    from deepinfer_core.errors import DeepInferError
    from deepinfer_core.spec_decode.config import parse_json_config

    try:
        options = with_batch_invariant(parse_options(args.option), args.batch_invariant)
        schema = read_json_schema(args.json_schema) if args.json_schema else None
        speculative = parse_json_config(args.speculative_config) if args.speculative_config is not None else None
        baselines = (None if args.compare_speculative is None
                     else [parse_baseline(entry) for entry in args.compare_speculative])
    except DeepInferError as exc:
        print(f"deepinfer bench: error: {exc}", file=sys.stderr)
        return 2
    report_plugin_failures("deepinfer bench", args.verbose)
    config = BenchConfig(
        model=args.model, preset=args.preset, input_len=args.input_len, output_len=args.output_len,
        num_prompts=args.num_prompts, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len, backend=args.backend,
        dtype=args.dtype,
        compare_hf=args.compare_hf, warmup=args.warmup, num_iters=args.num_iters, enforce_eager=args.enforce_eager,
        prefill_graphs=args.prefill_graphs, enable_mixed_chunk=args.enable_mixed_chunk,
        async_scheduling=args.async_scheduling, seed=args.seed, load_format=args.load_format,
        prefix_share=args.prefix_share,
        enable_prefix_state_cache=args.enable_prefix_state_cache, prefix_state_cache_bytes=args.prefix_state_cache_bytes,
        prefix_state_split_min_tokens=args.prefix_state_split_min_tokens,
        cache_dir=args.cache_dir, options=options, data_parallel_size=args.data_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel, json_schema=schema, speculative_config=speculative,
        prompts_file=args.prompts, compare_speculative=baselines,
    )
    try:
        result = run_bench(config, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    except (DeepInferError, PresetError, ValueError) as exc:
        print(f"deepinfer bench: error: {exc}", file=sys.stderr)
        return 2
    print(format_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


def with_batch_invariant(options: dict, flag: bool | None) -> dict:
    """``options`` with ``batch_invariant`` set from ``--batch-invariant`` / ``--no-batch-invariant`` (``flag``; None:
    unchanged); raise ``CommandLineOptionError`` when ``--option batch_invariant=...`` says otherwise."""
    from deepinfer_core.cli.options import CommandLineOptionError

    if flag is None:
        return options
    if "batch_invariant" in options and options["batch_invariant"] != flag:
        raise CommandLineOptionError(f"--{'' if flag else 'no-'}batch-invariant contradicts --option "
                                     f"batch_invariant={options['batch_invariant']!r}; give one of them")
    return {**options, "batch_invariant": flag}


def parse_baseline(entry: str) -> str | dict:
    """A ``--compare-speculative`` baseline: ``none`` or a method name as given, a JSON object as a dict;
    ``CommandLineOptionError`` for JSON that is not an object."""
    from deepinfer_core.cli.options import CommandLineOptionError

    if not entry.lstrip().startswith("{"):
        return entry
    try:
        config = json.loads(entry)
    except json.JSONDecodeError as exc:
        raise CommandLineOptionError(f"--compare-speculative {entry!r} is not valid JSON ({exc}); pass none, a method "
                                     """name or an object like '{"method": "mtp", "num_speculative_tokens": 5}'""") \
            from None
    if not isinstance(config, dict):
        raise CommandLineOptionError(f"--compare-speculative {entry!r} is not a JSON object")
    return config


def read_json_schema(path: str) -> dict:
    """The JSON schema in ``path``; ``CommandLineOptionError`` naming the file and what is wrong."""
    from deepinfer_core.cli.options import CommandLineOptionError

    try:
        schema = json.loads(Path(path).read_text())
    except OSError as exc:
        raise CommandLineOptionError(f"--json-schema {path}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise CommandLineOptionError(f"--json-schema {path}: not JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise CommandLineOptionError(f"--json-schema {path}: a schema is a JSON object, got {type(schema).__name__}")
    return schema

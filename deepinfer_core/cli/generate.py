"""``deepinfer generate``: complete prompts from the command line with the offline ``LLM`` API.

Examples::

    deepinfer generate "def fibonacci(n):"                        # the embedded default model
    deepinfer generate --model ./ckpt --max-tokens 32 --temperature 0 "first prompt" "second prompt"
    deepinfer generate --chat --n 2 --stop "return" "Write a function that adds two numbers"
    deepinfer generate --json "def f(x):" | jq '.[0].outputs[0].text'
    deepinfer generate --json-schema person.json "A person:"      # structured output (deepinfer[structured-output])
    deepinfer generate --choice yes,no "Is water wet?"

Sampling defaults (temperature, top-p, top-k) come from the checkpoint's ``generation_config.json`` when it
has them, else from ``SamplingParams``; the flags override both. On a terminal the completions stream as they are
generated (``--stream`` / ``--no-stream`` choose); ``--json`` prints the whole result at the end. Exit codes: 0 done,
2 bad arguments or model (invalid sampling values, unknown backend, model not found, a prompt the engine refuses),
130 interrupted (Ctrl-C; what was streamed stays on the screen).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from deepinfer_core.cli.options import add_option_argument, parse_options
from deepinfer_core.cli.plugin_failures import report_plugin_failures

HELP = "generate completions for prompts with the offline engine"
DEFAULT_MAX_TOKENS = 64
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k")
RULE = "=" * 72
_SHOWN_REFUSED_CHARS = 200  # a refused prompt longer than this is shown by its start and length


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``deepinfer generate`` options."""
    from deepinfer_core.engine_args import LOAD_FORMATS

    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text (one completion set per prompt)")
    parser.add_argument("--model", help="checkpoint folder or cached hub id (default: $DEEPINFER_HF_MODEL_DIR or the "
                                        "embedded default model)")
    parser.add_argument("--backend", help="backend name (default: $DEEPINFER_ACCELERATOR or automatic)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (default auto)")
    parser.add_argument("--max-model-len", type=int, help="longest prompt + output in tokens")
    parser.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                        help="auto / safetensors: read the checkpoint; dummy: random weights, only config.json and "
                             "the tokenizer read (timing; the output is noise)")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help=f"tokens to generate per completion (default {DEFAULT_MAX_TOKENS})")
    parser.add_argument("--temperature", type=float, help="0 is greedy (default: the model's, else 1.0)")
    parser.add_argument("--top-p", type=float, help="nucleus mass in (0, 1] (default: the model's, else 1.0)")
    parser.add_argument("--top-k", type=int, help="keep the k most likely tokens; 0 or -1 is off")
    parser.add_argument("--seed", type=int, default=0, help="base random seed (default 0)")
    parser.add_argument("--n", type=int, default=1, help="completions per prompt (default 1)")
    parser.add_argument("--stop", action="append", metavar="STR",
                        help="stop string; repeat the flag for several")
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE",
                            help="constrain the output to JSON satisfying the JSON schema in FILE (needs the "
                                 "deepinfer-structured-output plugin)")
    constraint.add_argument("--regex", metavar="R", help="constrain the output to match the regular expression R")
    constraint.add_argument("--choice", metavar="A,B",
                            help="constrain the output to one of the comma-separated strings")
    parser.add_argument("--chat", action="store_true",
                        help="treat each prompt as a user message and apply the model's chat template")
    parser.add_argument("--json", action="store_true", help="print RequestOutput-like JSON (one object per prompt)")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                        help="print completions as they are generated (default: on when stdout is a terminal, "
                             "off with --json)")
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="ranks, each its own engine on a share of the prompts (default 1; under torchrun: its "
                             "world size); see docs/distributed.md")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="split the routed experts across the data-parallel ranks")
    parser.add_argument("--speculative-config", metavar="JSON",
                        help="""speculative decoding, vLLM's dict as JSON, e.g. '{"method": "ngram", """
                             """"num_speculative_tokens": 3}' (docs/speculative.md)""")
    add_option_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Load the model, generate, print. Returns 0, or 2 with a message on stderr for bad input."""
    from deepinfer_core.errors import DeepInferError

    try:
        _check_sampling_flags(args)  # fail fast, before loading anything
        check_prompts(args.prompts)
        options = parse_options(args.option)
        report_plugin_failures("deepinfer generate", args.verbose)
        llm = _load(args, options)
        if args.verbose:
            print(f"deepinfer generate: backend {llm.backend_choice.name} ({llm.backend_choice.why})", file=sys.stderr)
        params = sampling_params(args, generation_defaults(llm.model_dir))
        started = time.perf_counter()
        outputs = _stream(llm, args, params) if _streams(args) else _generate(llm, args, params)
        if args.verbose:
            print(_throughput(outputs, time.perf_counter() - started), file=sys.stderr)
    except (DeepInferError, ValueError, TypeError) as exc:
        return _fail(exc, args)
    if not _prints_outputs():
        return 2 if any(o.error for o in outputs) else 0
    if args.json:
        print(json.dumps([output_dict(o) for o in outputs], indent=2))
    elif not _streams(args):
        print(format_outputs(outputs, args.prompts))
    refused = [(i, o) for i, o in enumerate(outputs) if o.error]
    for i, o in refused:
        print(f"deepinfer generate: error: prompt {i + 1}: {o.error}", file=sys.stderr)
    return 2 if refused else 0


def _throughput(outputs: list, seconds: float) -> str:
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return (f"deepinfer generate: {tokens} tokens for {len(outputs)} prompt(s) in {seconds:.2f} s "
            f"({tokens / max(seconds, 1e-9):.1f} tokens/s)")


def check_prompts(prompts: list[str]) -> None:
    """Raise ValueError naming the first prompt that is not UTF-8 text (a shell passes bytes through as they are)."""
    for i, prompt in enumerate(prompts):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raw = prompt[exc.start:exc.end].encode("utf-8", "surrogateescape").hex(" ")
            raise ValueError(f"prompt {i + 1} is not valid UTF-8 (bytes {raw} at character {exc.start}); pass UTF-8 "
                             "text (e.g. convert it with iconv -t UTF-8)") from None


def _fail(exc: Exception, args: argparse.Namespace) -> int:
    print(f"deepinfer generate: error: {exc}", file=sys.stderr)
    if getattr(args, "verbose", 0):
        import traceback

        traceback.print_exc()
    return 2


def _check_sampling_flags(args: argparse.Namespace) -> None:
    from deepinfer_core.sampling.params import SamplingParams

    SamplingParams(**_explicit_params(args))


def _explicit_params(args: argparse.Namespace) -> dict[str, Any]:
    """SamplingParams keyword arguments given on the command line."""
    values = {"n": args.n, "max_tokens": args.max_tokens, "stop": args.stop,
              "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
              "structured_outputs": _structured_outputs(args)}
    return {k: v for k, v in values.items() if v is not None}


def _structured_outputs(args: argparse.Namespace):
    """The ``StructuredOutputsParams`` of ``--json-schema`` / ``--regex`` / ``--choice``, or None."""
    from deepinfer_core.sampling.structured_outputs import StructuredOutputsParams

    if getattr(args, "json_schema", None) is not None:
        try:
            text = Path(args.json_schema).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"--json-schema {args.json_schema}: {exc.strerror or exc}") from None
        return StructuredOutputsParams(json=text)
    if getattr(args, "regex", None) is not None:
        return StructuredOutputsParams(regex=args.regex)
    if getattr(args, "choice", None) is not None:
        return StructuredOutputsParams(choice=[c for c in args.choice.split(",") if c])
    return None


def generation_defaults(model_dir: str | Path) -> dict[str, Any]:
    """Temperature / top-p / top-k from the checkpoint's ``generation_config.json`` (empty if none)."""
    path = Path(model_dir) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    if config.get("do_sample") is False:
        return {"temperature": 0.0}
    return {k: config[k] for k in _GENERATION_DEFAULTS if config.get(k) is not None}


def sampling_params(args: argparse.Namespace, defaults: dict[str, Any]):
    """The SamplingParams of the run: the model's defaults, overridden by the flags given."""
    from deepinfer_core.sampling.params import SamplingParams

    return SamplingParams(**{**defaults, **_explicit_params(args)})


def _load(args: argparse.Namespace, options: dict[str, Any]):
    from deepinfer_core.llm import LLM
    from deepinfer_core.spec_decode.config import parse_json_config

    speculative = parse_json_config(args.speculative_config) if args.speculative_config is not None else None
    return LLM(args.model, backend=args.backend, dtype=args.dtype, max_model_len=args.max_model_len,
               load_format=args.load_format,
               max_num_seqs=max(1, min(64, len(args.prompts) * args.n)), seed=args.seed,
               data_parallel_size=args.data_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
               speculative_config=speculative, **options)


def _prints_outputs() -> bool:
    """Under torchrun every rank has the outputs; rank 0 prints them."""
    from deepinfer_core.distributed.rank import rank_from_environment

    info = rank_from_environment()
    return info is None or info.rank == 0


def _generate(llm, args: argparse.Namespace, params) -> list:
    return llm.generate(_engine_prompts(llm, args), params, use_tqdm=False)


def _engine_prompts(llm, args: argparse.Namespace) -> list:
    """The prompts as given, or with ``--chat`` each as a user message in the model's chat template (``LLM.chat``)."""
    if not args.chat:
        return list(args.prompts)
    return [{"prompt_token_ids": llm.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                                    add_generation_prompt=True, tokenize=True)}
            for p in args.prompts]


def _streams(args: argparse.Namespace) -> bool:
    """Whether completions print as they are generated: never with --json, else as ``--stream`` says, else on a
    terminal."""
    if args.json or args.data_parallel_size > 1 or _under_launcher():  # ranks step in lockstep: no streaming
        return False
    return args.stream if args.stream is not None else sys.stdout.isatty()


def _under_launcher() -> bool:
    from deepinfer_core.distributed.rank import rank_from_environment

    return rank_from_environment() is not None


def _stream(llm, args: argparse.Namespace, params) -> list:
    """Generate, printing each snapshot's new text (``StreamPrinter``); returns the final outputs."""
    from deepinfer_core.cli.stream import StreamPrinter

    printer = StreamPrinter(args.prompts)
    outputs: list = []
    try:
        for outputs in llm.stream(_engine_prompts(llm, args), params):
            printer.update(outputs)
    except KeyboardInterrupt:
        printer.interrupted()
        raise
    printer.close()
    return outputs


# ------------------------------------------------------------------------------------------------ output
def format_outputs(outputs: list, prompts: list[str] | None = None) -> str:
    """Each prompt (as given, else the output's text or ids) followed by its completion(s), ruled off."""
    blocks = []
    for i, output in enumerate(outputs):
        lines = prompt_lines(i, len(outputs), output, prompts[i] if prompts is not None else None)
        for c in output.outputs:
            lines.append(f"--- {completion_label(c, len(output.outputs))} (finish: {c.finish_reason}, "
                         f"{len(c.token_ids)} tokens):")
            lines.append(c.text)
        blocks.append("\n".join(lines))
    return "\n".join(blocks) + f"\n{RULE}"


def prompt_lines(index: int, total: int, output, shown: str | None = None) -> list[str]:
    """A prompt's header: the rule, its number, its text (``shown``, else the output's text or ids; a refused
    prompt's only by its start and length) and why it was refused."""
    shown = shown if shown is not None else output.prompt
    shown = shown if shown is not None else str(output.prompt_token_ids)
    if output.error and len(shown) > _SHOWN_REFUSED_CHARS:
        shown = f"{shown[:_SHOWN_REFUSED_CHARS]}... ({len(shown)} characters)"
    lines = [f"{RULE}\nprompt {index + 1} of {total}:" if total > 1 else f"{RULE}\nprompt:", shown]
    if output.error:
        lines.append(f"--- refused: {output.error}")
    return lines


def completion_label(completion, total: int) -> str:
    """``completion``, or ``completion i of n`` when the prompt has several."""
    return f"completion {completion.index + 1} of {total}" if total > 1 else "completion"


def output_dict(output) -> dict[str, Any]:
    """A RequestOutput as plain JSON-able data (same field names as vLLM's RequestOutput)."""
    data = dataclasses.asdict(output)
    for completion in data["outputs"]:
        completion["token_ids"] = list(completion["token_ids"])
    return data

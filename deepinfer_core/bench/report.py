"""The human-readable table of a ``deepinfer bench`` result dict."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_ROWS = (
    # label, metric key, stat key (None for scalars), scale, unit
    ("total time", "total_time_s", None, 1.0, "s"),
    ("output tok/s", "output_throughput", None, 1.0, ""),
    ("total tok/s", "total_throughput", None, 1.0, ""),
    ("requests/s", "requests_per_s", None, 1.0, ""),
    ("TTFT mean", "ttft_s", "mean", 1e3, "ms"),
    ("TTFT p50", "ttft_s", "p50", 1e3, "ms"),
    ("TTFT p99", "ttft_s", "p99", 1e3, "ms"),
    ("TTFT hit", "ttft_hit_s", "mean", 1e3, "ms"),
    ("TTFT miss", "ttft_miss_s", "mean", 1e3, "ms"),
    ("TPOT mean", "tpot_s", "mean", 1e3, "ms"),
    ("TPOT p50", "tpot_s", "p50", 1e3, "ms"),
    ("TPOT p99", "tpot_s", "p99", 1e3, "ms"),
    ("latency mean", "latency_s", "mean", 1.0, "s"),
    ("cached tok mean", "num_cached_tokens", "mean", 1.0, ""),
    ("steps", "steps", None, 1.0, ""),
    ("GC pauses", "gc_pauses", "count", 1.0, ""),
    ("GC total", "gc_pauses", "total_s", 1e3, "ms"),
    ("GC max", "gc_pauses", "max_s", 1e3, "ms"),
    ("load time", "load_time_s", None, 1.0, "s"),
)


def format_report(result: Mapping[str, Any]) -> str:
    """Header lines (settings, machine), one row per metric with engine / HF / ratio columns, roofline."""
    lines = _header(result["config"], result["engine"])
    hf = result.get("hf")
    lines += ["", f"{'metric':<16}{'engine':>14}" + (f"{'HF':>14}{'engine/HF':>12}" if hf else "")]
    lines.append("-" * (30 + (26 if hf else 0)))
    for label, key, stat, scale, unit in _ROWS:
        lines.append(_row(label, key, stat, scale, unit, result["engine"], hf))
    lines += ["", *_roofline_lines(result["roofline"]), *_plugin_lines(result["engine"])]
    if result.get("agreement"):
        a = result["agreement"]
        lines.append(f"greedy agreement with HF: {a['identical_requests']}/{a['num_requests']} requests identical, "
                     f"mean common prefix {100 * a['mean_prefix_fraction']:.1f}% of the output")
    if result.get("ratio"):
        lines.append(f"engine/HF output throughput: {result['ratio']['output_throughput']:.2f}x")
    if result.get("structured_output"):
        lines.append(_masks(result["structured_output"]))
    if result["engine"].get("speculative"):
        lines.append(_speculation(result["config"].get("speculative_config") or {}, result["engine"]["speculative"]))
    if result.get("speculative_comparison"):
        lines += ["", *_comparison(result["speculative_comparison"])]
    return "\n".join(lines)


_COMPARISON_COLUMNS = (
    # header, row key, format, scale
    ("out tok/s", "output_throughput", "{:.1f}", 1),
    ("vs none", "speedup_vs_none", "{:.2f}x", 1),
    ("steps", "steps", "{}", 1),
    ("step ms p50", "step_time_p50_s", "{:.2f}", 1e3),
    ("accept len", "acceptance_length", "{:.3f}", 1),
    ("verif/round", "verified_per_draft", "{:.2f}", 1),
    ("verif/step", "verified_per_step", "{:.1f}", 1),
    ("drafted", "num_draft_tokens", "{}", 1),
    ("verified", "num_verified_tokens", "{}", 1),
    ("accepted", "num_accepted_tokens", "{}", 1),
)


def _comparison(comparison: Mapping[str, Any]) -> list[str]:
    """``--compare-speculative``: one row per run (same prompts, one process), then how many requests kept the
    ``none`` run's tokens."""
    runs = comparison["runs"]
    width = max(len(run["label"]) for run in runs) + 2
    lines = [("speculative decoding compared (same prompts, one process; verif/round: verified draft tokens per "
              "sequence per step, verif/step: per engine step):"),
             f"{'run':<{width}}" + "".join(f"{column[0]:>12}" for column in _COMPARISON_COLUMNS)]
    lines.append("-" * len(lines[-1]))
    for run in runs:
        cells = ["-" if run[key] is None else fmt.format(run[key] * scale)
                 for _, key, fmt, scale in _COMPARISON_COLUMNS]
        lines.append(f"{run['label']:<{width}}" + "".join(f"{cell:>12}" for cell in cells))
    if comparison["baseline"] is not None:
        same = ", ".join(f"{run['label']} {run['same_outputs_as_none']}/{comparison['num_requests']}"
                         for run in runs if run["speculative_config"] is not None)
        lines.append(f"requests with the none run's tokens: {same}")
    return lines


def _speculation(config: Mapping[str, Any], figures: Mapping[str, Any]) -> str:
    """The speculative decoding line: acceptance length, drafts, verified and accepted tokens, per step."""
    head = f"speculative decoding ({config.get('method')}, k = {config.get('num_speculative_tokens')}): "
    if figures["acceptance_length"] is None:
        return head + "no draft was verified in the timed runs"
    return (head + f"acceptance length {figures['acceptance_length']:.2f}, {figures['num_drafts']} drafts, "
            f"{figures['num_verified_tokens']} verified and {figures['num_accepted_tokens']} accepted tokens "
            f"(per position {figures['accepted_per_pos']}), {figures['verified_per_draft']:.2f} verified tokens per "
            f"draft round (sequence and step), {figures['verified_per_step']:.2f} per engine step")


def _masks(masks: Mapping[str, Any]) -> str:
    hidden = masks["hidden_share"]
    return (f"structured output: token masks {masks['mask_us_per_row']:.0f} us per row on the host ({masks['rows']} "
            f"rows, {1e3 * masks['prepare_s']:.1f} ms), the engine waited {1e3 * masks['wait_s']:.1f} ms of it"
            + (f" ({100 * hidden:.0f}% hidden)" if hidden is not None else ""))


def _header(config: Mapping[str, Any], engine: Mapping[str, Any]) -> list[str]:
    source = f"preset {config['preset']}" if config.get("preset") else "model"
    return [
        f"deepinfer bench: {source} {config['model_folder']}",
        (f"  {config['num_prompts']} prompts x {config['input_len']} tokens in{_share(config)}, "
         f"{config['output_len']} out "
         f"({'greedy, JSON schema, ending with the grammar' if config.get('json_schema') else 'greedy, EOS ignored'}); "
         f"max_num_seqs {config['max_num_seqs']}, max_num_batched_tokens "
         f"{config['max_num_batched_tokens']}{_model_len(config)}, async scheduling {_on(config.get('async_scheduling'))}, "
         f"mixed chunks {_on(config.get('enable_mixed_chunk'))}, warmup {config['warmup']}{_iterations(engine)}"),
        (f"  device {config['device']}, dtype {config['dtype']}, torch {config['torch']} "
         f"({config['torch_threads']} threads), {config['date']}{_load(config)}"),
        f"  {engine['output_tokens']} output tokens, {engine['prompt_tokens']} prompt tokens{_computed(engine)}",
    ] + _environment(config)


def _model_len(config: Mapping[str, Any]) -> str:
    """The engine's ``max_model_len`` where it is longer than the requests need (``--max-model-len``), else nothing."""
    model_len = config.get("max_model_len")
    return f", max_model_len {model_len}" if model_len and model_len > config["input_len"] + config["output_len"] else ""


def _share(config: Mapping[str, Any]) -> str:
    """The common prefix of every prompt (``--prefix-share``), or nothing without one."""
    share = config.get("prefix_share")
    if not share:
        return ""
    cached = "cached by the warm-up" if config.get("warmup") else "no warm-up to cache it"
    return f" (the first {config['prefix_len']} a common prefix, share {share:g}, {cached})"


def _computed(engine: Mapping[str, Any]) -> str:
    """How many prompt tokens the engine computed, where prefix hits left some out."""
    computed = engine.get("computed_prompt_tokens")
    return "" if computed in (None, engine["prompt_tokens"]) else f" ({computed} computed)"


def _environment(config: Mapping[str, Any]) -> list[str]:
    """The ``DEEPINFER_*`` variables the run saw (they switch kernels on and off), one line, or nothing."""
    settings = config.get("environment") or {}
    return [f"  environment: {', '.join(f'{name}={value}' for name, value in settings.items())}"] if settings else []


def _load(config: Mapping[str, Any]) -> str:
    """The host's 1-minute load average (CPU figures on a shared machine are noisy), or nothing if unknown."""
    load = config.get("load_average")
    return f", load {load[0]:.1f} on {config.get('cpu_count')} CPUs" if load else ""


def _row(label: str, key: str, stat: str | None, scale: float, unit: str, engine: Mapping[str, Any],
         hf: Mapping[str, Any] | None) -> str:
    e = _value(engine, key, stat)
    text = f"{label + (f' ({unit})' if unit else ''):<16}{_fmt(e, scale):>14}"
    if hf is None:
        return text
    h = _value(hf, key, stat)
    ratio = _ratio(key, e, h)
    return text + f"{_fmt(h, scale):>14}{ratio:>12}"


def _value(metrics: Mapping[str, Any], key: str, stat: str | None) -> float | None:
    value = metrics[key]
    return value[stat] if stat is not None else value


def _ratio(key: str, e: float | None, h: float | None) -> str:
    """engine/HF for rates; HF/engine (a speed-up) for times; blank for counts."""
    if e is None or h is None or not e or not h or key in ("steps", "gc_pauses", "num_cached_tokens"):
        return ""
    value = e / h if key.endswith(("throughput", "per_s")) else h / e
    return f"{value:.2f}x"


def _fmt(value: float | None, scale: float) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    scaled = value * scale
    return f"{scaled:,.1f}" if abs(scaled) >= 100 else f"{scaled:.3g}"


def _roofline_lines(roofline: Mapping[str, Any]) -> list[str]:
    lines = []
    for side, value in roofline.items():
        name = "engine" if side == "engine" else "HF"
        if isinstance(value, str):
            lines.append(f"roofline ({name}): {value}")
        else:
            lines.append(f"roofline ({name}): {100 * value['fraction']:.1f}% of the {value['device']} floor "
                         f"({value['floor_s'] * 1e3:.2f} ms: prefill {value['prefill_floor_s'] * 1e3:.2f} ms "
                         f"of {value['prefill_tokens']:,} prompt tokens, decode {value['decode_floor_s'] * 1e3:.2f} "
                         "ms)")
            if "fp8_fraction" in value:
                lines.append(f"roofline ({name}) with the quantized weights' products at the fp8 peak: "
                             f"{100 * value['fp8_fraction']:.1f}% ({value['fp8_floor_s'] * 1e3:.2f} ms: prefill "
                             f"{value['fp8_prefill_floor_s'] * 1e3:.2f} ms)")
    return lines


def _plugin_lines(engine: Mapping[str, Any]) -> list[str]:
    """The ranks (with data parallelism) and EPLB's balance line when it rebalanced."""
    figures = engine.get("engine_metrics") or {}
    lines = []
    ranks = engine.get("ranks")
    if ranks:
        requests = ", ".join(str(rank["requests"]) for rank in ranks)
        idle = ", ".join(str(rank["idle_steps"]) for rank in ranks)
        lines.append(f"ranks: {len(ranks)} (requests {requests} in the last run; idle steps {idle} since start-up)")
    if figures.get("deepinfer:eplb_rebalances"):
        lines.append(f"moe_lb (EPLB, busiest rank / mean, latest window): {figures['deepinfer:eplb_moe_lb']:.3f} "
                     f"(before the rebalance {figures['deepinfer:eplb_moe_lb_before']:.3f}, static layout "
                     f"{figures['deepinfer:eplb_moe_lb_static']:.3f}; {figures['deepinfer:eplb_rebalances']} "
                     "rebalances)")
    return lines


def _iterations(engine: Mapping[str, Any]) -> str:
    totals = engine.get("iteration_total_times_s") or []
    if len(totals) < 2:
        return ""
    firsts = engine.get("iteration_first_token_s") or []
    return (f", {len(totals)} timed runs (median shown; totals {', '.join(f'{t:.3f}' for t in totals)} s; first "
            f"tokens {', '.join(f'{1e3 * t:.1f}' for t in firsts)} ms)")


def _on(flag: bool | None) -> str:
    return {True: "on", False: "off"}.get(flag, "-")

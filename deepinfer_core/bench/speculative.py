"""``deepinfer bench --compare-speculative``: the run's speculative config against baselines, in one process.

Every run loads its own engine (``LLM`` builds its proposer once), warms up and times the same prompts; the runs go
in table order, the baselines first and the ``--speculative-config`` run last. A baseline is ``"none"`` (no
speculation), a method name (that method with the run's ``num_speculative_tokens``: ``"mtp"`` is fixed-k MTP with
the same draft layer DSpark uses), or a whole ``speculative_config`` dict. Each row has output tok/s, its speedup
over the ``none`` run, engine steps, the acceptance length, verified draft tokens per draft round (per sequence per
step: DSpark's "verified tokens per step") and per engine step, drafted / verified / accepted tokens, the median
engine step time (drafting included), and how many requests produced the same tokens as the ``none`` run (greedy: all
of them, up to near-ties of the target's logits).

With a random draft layer (the ``-mtp`` presets) nothing is accepted, so every decode step of an ``mtp`` run with
``num_speculative_tokens`` k verifies k + 1 tokens per sequence: ``none`` and ``mtp`` at k = 1 .. 5 give the median
step at 1 .. 6 tokens per sequence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from deepinfer_core import envs
from deepinfer_core.bench.runner import stats
from deepinfer_core.spec_decode.config import COMMON_KEYS, SpeculativeConfig, SpeculativeConfigError

NONE = "none"
DEFAULT_BASELINES = (NONE, "mtp")
"""``--compare-speculative`` given without baselines: no speculation and fixed-k MTP."""


def comparison_runs(main: Mapping[str, Any], baselines: Sequence[str | Mapping[str, Any]]
                    ) -> list[tuple[str, dict[str, Any] | None]]:
    """``(label, speculative_config or None)`` of every run, in table order: ``baselines`` (an empty list: the
    default ``none`` and ``mtp``), then ``main``; a baseline equal to ``main`` is run once. Raises
    ``SpeculativeConfigError`` for a baseline that is neither ``"none"``, a method name nor a dict, and for a
    ``none`` run that ``DEEPINFER_USE_NEXTN_DECODE`` would turn into DSpark."""
    k = main.get("num_speculative_tokens")
    runs: list[tuple[str, dict[str, Any] | None]] = []
    for entry in baselines or DEFAULT_BASELINES:
        config = _baseline(entry, k)
        if config != dict(main) and all(config != other for _, other in runs):
            runs.append((label(config), config))
    if any(config is None for _, config in runs) and envs.DEEPINFER_USE_NEXTN_DECODE:
        raise SpeculativeConfigError(f"--compare-speculative {NONE!r} runs without speculation, but "
                                     f"DEEPINFER_USE_NEXTN_DECODE={envs.DEEPINFER_USE_NEXTN_DECODE} turns an engine "
                                     "without speculative_config into DSpark; unset the variable")
    return [*runs, (label(dict(main)), dict(main))]


def check_configs(runs: Sequence[tuple[str, Mapping[str, Any] | None]]) -> None:
    """Check every run's ``speculative_config`` against the registered proposers (the core's and the installed
    plugins', as ``LLM`` loads them) before the first run starts: an unknown method or key fails now, not after the
    runs before it."""
    from deepinfer_core.plugins import get_plugin_manager
    from deepinfer_core.spec_decode.proposer import default_registry

    methods = default_registry(get_plugin_manager()).methods()
    for _, config in runs:
        if config is not None:
            SpeculativeConfig.from_dict(config, methods)


def _baseline(entry: str | Mapping[str, Any], k: int) -> dict[str, Any] | None:
    if isinstance(entry, Mapping):
        return dict(entry)
    if not isinstance(entry, str) or not entry:
        raise SpeculativeConfigError(f"--compare-speculative takes {NONE!r}, a method name (run with the "
                                     f"--speculative-config's num_speculative_tokens) or a speculative_config JSON "
                                     f"object; got {entry!r}")
    return None if entry == NONE else {"method": entry, "num_speculative_tokens": k}


def label(config: Mapping[str, Any] | None) -> str:
    """A run's name in the table: ``none``, or the method, ``k`` and its own keys (``dspark k=5
    verify_fraction=0.7``)."""
    if config is None:
        return NONE
    extra = [f"{key}={value}" for key, value in config.items() if key not in COMMON_KEYS]
    return " ".join([str(config.get("method")), f"k={config.get('num_speculative_tokens')}", *extra])


def comparison_row(name: str, config: Mapping[str, Any] | None, metrics: Mapping[str, Any],
                   outputs: Sequence[Sequence[int]]) -> dict[str, Any]:
    """One run's row (before the speedups, which ``finish_rows`` adds): throughput, steps, draft figures."""
    figures = metrics.get("speculative") or {}
    return {
        "label": name, "speculative_config": dict(config) if config is not None else None,
        "output_throughput": metrics["output_throughput"], "total_time_s": metrics["total_time_s"],
        "tpot_mean_s": metrics["tpot_s"]["mean"], "steps": metrics["steps"],
        "step_time_p50_s": stats(metrics["step_times_s"])["p50"],  # a decode step's (with its draft) when most are
        **{key: figures.get(key) for key in ("acceptance_length", "verified_per_draft", "verified_per_step",
                                             "num_drafts", "num_draft_tokens", "num_verified_tokens",
                                             "num_accepted_tokens")},
        "outputs": [list(o) for o in outputs],
    }


def finish_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The comparison: each row with ``speedup_vs_none`` (output tok/s over the ``none`` run's) and
    ``same_outputs_as_none`` (requests whose tokens equal the ``none`` run's), None where there is no ``none`` run;
    the rows' token lists are dropped."""
    outputs = [row.pop("outputs") for row in rows]
    base = next((i for i, row in enumerate(rows) if row["speculative_config"] is None), None)
    for row, tokens in zip(rows, outputs, strict=True):
        if base is None:
            row["speedup_vs_none"] = row["same_outputs_as_none"] = None
            continue
        row["speedup_vs_none"] = row["output_throughput"] / rows[base]["output_throughput"]
        row["same_outputs_as_none"] = sum(a == b for a, b in zip(tokens, outputs[base], strict=True))
    return {"baseline": NONE if base is not None else None, "num_requests": len(outputs[0]) if outputs else 0,
            "runs": rows}

"""The plugin contract: every hook a ``deepinfer.plugins`` entry point may implement.

This module is the whole contract between the core and its plugins (pluggy project ``"deepinfer"``).
A plugin is a module (or object) that

* declares ``DEEPINFER_HOOK_API_VERSION = 1`` (the integer ``HOOK_API_VERSION`` below; the core refuses
  a plugin that declares another version or none), and
* implements some of the hooks below as functions with the same name, marked with ``@hookimpl``
  (``from deepinfer_core.hookspecs import hookimpl``). An implementation may accept any subset of a
  spec's arguments, by name; a name that is not an argument of the spec, or a ``deepinfer_*`` function
  that matches no spec, makes the core reject the plugin at load time, naming the plugin and the hook.

Hooks are called in pluggy's order: the plugin registered last runs first. The core registers
entry-point plugins sorted by entry-point name, so the order is the same in every process. The core calls
every hook through ``deepinfer_core.plugins.call_hook``: an implementation that raises fails the call with an
error naming the plugin, the hook and the original exception (``PluginHookError``; a ``DeepInferError`` the
plugin raises on purpose keeps its class, its message prefixed with the plugin and the hook).

Every argument is typed with a class the core exports; ``HOOK_ARGUMENT_TYPES`` lists them and the generated
reference shows their fields. Per-engine state belongs in ``EngineContext.plugin_state``, not in module globals:
two engines in one process get two contexts.

Run ``python -m deepinfer_core.hookspecs --markdown`` to print the hook reference that
``docs/plugins.md`` embeds (``--write docs/plugins.md`` updates it in place).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from deepinfer_core.engine.engine import Engine
    from deepinfer_core.engine.model_runner import ModelRunnerOutput
    from deepinfer_core.engine.prefix_replay import PrefixHit
    from deepinfer_core.engine.request import Request
    from deepinfer_core.engine.scheduler import SchedulerOutput
    from deepinfer_core.engine_context import EngineContext
    from deepinfer_core.models.registry import ModelRegistry
    from deepinfer_core.ops.table import OpTable
    from deepinfer_core.sampling.logits_processor import LogitsProcessorLike
    from deepinfer_core.spec_decode.proposer import ProposerRegistry

PROJECT_NAME = "deepinfer"
"""The pluggy project name: markers made with another name are ignored by the core."""

HOOK_API_VERSION = 1
"""Integer version of this contract. Bumped only on an incompatible change (a hook removed, renamed, or an
argument's meaning changed); adding a hook or an argument is compatible and keeps the number."""

PLUGIN_VERSION_ATTRIBUTE = "DEEPINFER_HOOK_API_VERSION"
"""The module attribute by which a plugin declares which ``HOOK_API_VERSION`` it was written against."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# --- configuration -------------------------------------------------------------------------------


@hookspec
def deepinfer_feature_options() -> Mapping[str, str]:
    """Declare the feature options this plugin accepts.

    Runs: when the engine validates the options a user passed (``LLM(..., batch_invariant=True)``,
    ``--option name=value``), before ``deepinfer_configure`` and before any model work.

    Arguments: none.

    Return: a mapping of option name to a one-line description, e.g.
    ``{"batch_invariant": "bitwise identical logits whatever the batch"}``. The core rejects an option
    that no plugin (and not the core itself) claims, with an error naming the option and every claimed
    name. Two plugins may claim the same name; both then see it in ``deepinfer_configure``. A plugin that
    claims options counts as active only when one of its options is set (see
    ``deepinfer_supported_backends``). Return ``None`` or an empty mapping to claim nothing.
    """


@hookspec
def deepinfer_supported_backends() -> Iterable[str] | None:
    """Declare the backends this plugin works with.

    Runs: after the backend is selected and the options are validated, before ``deepinfer_configure``,
    so an unsupported combination fails before any weights are loaded.

    Arguments: none.

    Return: an iterable of backend names (entry-point names in ``deepinfer.backends``, e.g. ``"cpu"``,
    ``"nvidia_sm100"``, ``"ascend950"``), or ``None`` for "every backend". When the selected backend is
    not in the list and the plugin is active, the core raises ``UnsupportedBackendError`` naming the
    plugin, the backend and the supported ones. A plugin is active when it claims no feature options, or
    when the user set at least one of the options it claims.
    """


@hookspec(historic=True)
def deepinfer_configure(
    config: Mapping[str, str] | None, options: Mapping[str, object], context: EngineContext
) -> None:
    """Receive the engine's context and the feature options, once per engine.

    Runs: when an engine is created, after option validation and the backend check, before the op
    table, the model and the scheduler are built; in every process that builds an engine or an engine
    worker. Historic: a plugin registered after the call is called at registration with the arguments
    of every earlier call. It runs once per engine, so several times in a process that builds several.

    Arguments:
    - ``config``: ``{"model": <checkpoint folder>}`` (the same as ``context.model_dir``; kept for plugins
      written before ``context``), or None outside an engine.
    - ``options``: a read-only mapping of every feature option the user set, by name (options not
      claimed by any plugin never get here: they are rejected first). A plugin reads its own options
      here, e.g. ``options.get("batch_invariant", False)``. The same mapping as ``context.options``.
    - ``context``: the engine's ``EngineContext`` (backend, device, dtype, model folder and config,
      tokenizer, engine arguments). Keep what you decide for this engine in
      ``context.plugin_state["<your plugin>"]`` and read it back in the other hooks, which get the same
      context; module globals would leak between two engines of one process.

    Return: ignored. Raise to refuse the configuration: the user gets the message with the plugin's and
    the hook's names in front.
    """


# --- registries ----------------------------------------------------------------------------------


@hookspec
def deepinfer_register_ops(op_table: OpTable, backend_name: str, context: EngineContext) -> None:
    """Add op overrides to the op table the model will call.

    Runs: once per op table, in ``Backend.make_op_table``, after the backend's own overrides and after
    ``deepinfer_configure``.

    Arguments:
    - ``op_table``: the ``deepinfer_core.ops.table.OpTable`` being built. Call
      ``op_table.override(name, fn, source="<your plugin>")``; ``getattr(op_table, name)`` gives the
      current implementation, so an override may wrap it. Never patch modules instead.
    - ``backend_name``: the selected backend's name, for plugins whose ops differ per device.
    - ``context``: the engine's ``EngineContext`` (the one ``deepinfer_configure`` got), or a bare
      context of ``backend_name`` with no options when a table is built outside an engine.

    Return: ignored. An override must match the reference op's signature and results (within the op's
    documented tolerance); ``op_table.sources()`` shows who provides each op.
    """


@hookspec
def deepinfer_register_models(registry: ModelRegistry, context: EngineContext | None) -> None:
    """Register model loaders with the core's model registry.

    Runs: once per engine, when it builds its model registry, before the checkpoint is loaded.

    Arguments:
    - ``registry``: the engine's ``deepinfer_core.models.registry.ModelRegistry``. Call
      ``registry.register(model_type, loader)``: ``model_type`` is the ``model_type`` of a checkpoint's
      ``config.json``, ``loader(folder, ops, dtype=..., device=...)`` builds the model from that folder
      and calls only ops of the op table ``ops``. The model must satisfy ``deepinfer_core.models.interface.CausalLM``
      (the registry refuses one that lacks a member, naming it); one that also satisfies ``StaticStepModel`` has its
      decode steps and lone prompts replayed from device graphs.
    - ``context``: the engine's ``EngineContext``, or None when a registry is built outside an engine.

    Return: ignored. Registering a ``model_type`` the core already handles replaces the core's loader.
    """


@hookspec
def deepinfer_register_proposers(registry: ProposerRegistry, context: EngineContext | None) -> None:
    """Register speculative-decoding proposers (draft methods) with the core's proposer registry.

    Runs: once per engine whose ``speculative_config`` (or ``DEEPINFER_USE_NEXTN_DECODE``) is set, after the model
    is loaded and before the config is checked (so a method this hook registers is a valid ``"method"``).

    Arguments:
    - ``registry``: the engine's ``deepinfer_core.spec_decode.ProposerRegistry`` (the core's ``"ngram"`` already
      in it). Call ``registry.register(method, factory, keys=(...))``: ``factory(config, target, context)`` returns
      a ``deepinfer_core.spec_decode.Proposer`` given the ``SpeculativeConfig``, the target model and ``context``;
      ``keys`` are the ``speculative_config`` keys the method takes beyond ``method`` and
      ``num_speculative_tokens``. Each step the engine calls ``Proposer.propose(DraftBatch) -> list[Draft]``
      (docs/speculative.md); verification, rollback and metrics are the core's.
    - ``context``: the engine's ``EngineContext``, or None when a registry is built outside an engine.

    Return: ignored. Registering a method again (``"ngram"`` too) replaces it.
    """


@hookspec
def deepinfer_logits_processors(context: EngineContext) -> Sequence[LogitsProcessorLike] | None:
    """Contribute logits processors to an engine.

    Runs: once per engine, after ``deepinfer_configure`` and the model load, before the first step.

    Arguments:
    - ``context``: the engine's ``EngineContext`` (its options, tokenizer, ``plugin_state``).

    Return: a list of logits processors, or ``None`` / ``[]`` for none. A processor is called as
    ``processor(logits, rows) -> logits`` on every step with ``logits`` float32 ``[num_rows, vocab]`` on the
    device, after the built-in sampling controls (penalties, ``min_tokens``, ``allowed_token_ids``,
    ``bad_words``, ``logit_bias``), and ``rows`` one ``deepinfer_core.sampling.LogitsRow`` per row (request id,
    ``SamplingParams`` with ``extra_args``, prompt and output token ids). Only rows sampled this step are
    passed, and of those only the ones whose ``params`` the processor's optional ``applies_to(params)`` accepts.
    ``needs_latest_tokens = True`` on the processor makes ``output_token_ids`` include the token sampled in the
    step before under asynchronous scheduling (the engine then waits for it). A two-phase processor
    (``deepinfer_core.sampling.logits_processor.TwoPhaseLogitsProcessor``: ``prepare(rows)`` and ``apply(logits,
    rows, handle)``) does its host work in ``prepare``, on the engine's worker thread beside the step's forward pass
    and with complete rows, and the sampler calls ``apply``. Processors run after any device
    graph, in this order: ``LLM(logits_processors=[...])``, then the plugins' in entry-point name order.
    Subclass ``deepinfer_core.sampling.LogitsProcessor`` for the defaults.
    """


# --- engine lifecycle ----------------------------------------------------------------------------


@hookspec
def deepinfer_engine_start(engine: Engine) -> None:
    """The engine is built and about to serve its first request.

    Runs: once per engine, after the model is loaded and the KV cache is allocated.

    Arguments:
    - ``engine``: the ``deepinfer_core.engine.engine.Engine``; read-only. ``engine.context`` is the
      ``EngineContext`` the configure hooks got (``plugin_state`` included); ``engine.config`` its sizes.

    Return: ignored. Raise to abort start-up; the engine shuts down and re-raises.
    """


@hookspec
def deepinfer_before_step(engine: Engine, scheduler_output: SchedulerOutput) -> None:
    """A scheduled batch is about to run on the device.

    Runs: every engine step, after ``Scheduler.schedule()`` and before the model runs.

    Arguments:
    - ``engine``: the engine.
    - ``scheduler_output``: the ``SchedulerOutput`` the scheduler chose for this step: ``chunks`` (each a
      ``ScheduledChunk``: ``request``, ``start``, ``num_tokens``, ``samples``) and ``preempted`` requests.

    Return: ignored. Must not change the token counts of the batch; keep it cheap, it is on the hot path.
    """


@hookspec
def deepinfer_after_step(engine: Engine, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput) -> None:
    """A batch has run; its outputs are about to update the scheduler.

    Runs: every engine step, once the step's sampled tokens are read, before ``Scheduler.update()`` appends them. With
    asynchronous scheduling (``LLM(async_scheduling=True)``, the NVIDIA default) the next step has already been
    scheduled and launched by then: ``deepinfer_before_step`` of step N + 1 runs before this hook of step N.

    Arguments:
    - ``engine``: the engine.
    - ``scheduler_output``: the same object ``deepinfer_before_step`` saw.
    - ``model_output``: the step's ``deepinfer_core.engine.model_runner.ModelRunnerOutput`` on the host:
      ``req_ids`` (row order), ``sampled_token_ids``, ``logprobs``, ``ranks``, top logprobs, prompt logprobs. A
      request that verified draft tokens (speculative decoding) has one row per token it took, in order.

    Return: ignored. Treat ``model_output`` as read-only; keep it cheap, it is on the hot path.
    """


@hookspec
def deepinfer_step_boundary(engine: Engine) -> None:
    """A data-parallel rank is between two steps, at the same point as every other rank.

    Runs: on each rank of a data-parallel engine (``data_parallel_size > 1``, ``deepinfer_core/distributed``), after
    every lockstep iteration, whether the rank ran an engine step or an idle step (no work of its own), before the
    next iteration's forward. Every rank calls it the same number of times in the same order, so an implementation
    may run collectives over the ranks (EPLB all-reduces the router load and moves expert weights here). With
    asynchronous scheduling the step just launched may still be running on the device: device work the hook enqueues
    runs after it. Not called in one process.

    Arguments:
    - ``engine``: the rank's engine; ``engine.model`` its model (``models/interface.py``: change it only through its
      declared interface, e.g. ``ExpertBalancedModel.set_expert_placement``).

    Return: ignored. Must leave every request's results as they would be without the hook (no request added, dropped
    or changed); a collective it starts must be one every rank starts.
    """


@hookspec
def deepinfer_engine_shutdown(engine: Engine) -> None:
    """The engine is shutting down.

    Runs: once per engine that ran ``deepinfer_engine_start``, on normal exit and on errors.

    Arguments:
    - ``engine``: the engine, still intact.

    Return: ignored. Release what the plugin holds for this engine; do not raise.
    """


# --- selectors -----------------------------------------------------------------------------------


@hookspec(firstresult=True)
def deepinfer_adopt_prefix_hit(hit: PrefixHit, context: EngineContext | None) -> int | None:
    """Choose how much of a prefix-cache hit a request adopts.

    Runs: in the scheduler, when a waiting request is admitted and the cache holds blocks of its first
    ``hit.num_cached_tokens`` tokens; before ``deepinfer_rebuild_sliding_window``. The first plugin that
    returns something other than ``None`` decides; later plugins are not called.

    Arguments:
    - ``hit``: the ``deepinfer_core.engine.prefix_replay.PrefixHit`` (the request, the hit's length, the
      block size, the model's window and its exact replay span).
    - ``context``: the engine's ``EngineContext`` (read this engine's decision from its ``plugin_state``),
      or None for an engine built without one.

    Return: ``None`` adopts the whole hit. An int ``adopted``, a multiple of ``hit.block_size`` with
    ``0 <= adopted <= hit.num_cached_tokens``, adopts the cached blocks of the first ``adopted`` tokens
    only: their compressed entries are read from the cache and the request computes the rest
    (``0``: no block is taken, a cold run). Any other value fails admission with ``PluginReturnError``.
    """


@hookspec(firstresult=True)
def deepinfer_rebuild_sliding_window(
    request: Request, num_cached_tokens: int, sliding_window: int, hit: PrefixHit, context: EngineContext | None
) -> int | None:
    """Choose how a request rebuilds its sliding-window KV after a prefix-cache hit that lacks it.

    Runs: in the scheduler, when a request adopts a prefix-cache hit of ``num_cached_tokens`` tokens of
    compressed KV (after ``deepinfer_adopt_prefix_hit``; never for a hit adopted to 0 tokens) but the
    sliding-window KV of those tokens is not cached. The first plugin that returns something other than
    ``None`` decides; later plugins are not called.

    Arguments:
    - ``request``: the engine's ``Request`` (``request_id``, ``prompt_token_ids``, ``params``, ...).
    - ``num_cached_tokens``: length of the adopted prefix-cache hit, in tokens.
    - ``sliding_window``: the model's attention window, in tokens (128 for DeepSeek-V4).
    - ``hit``: the whole ``PrefixHit`` (``hit.num_cached_tokens`` is the hit before adoption).
    - ``context``: the engine's ``EngineContext``, or None for an engine built without one.

    Return: ``None`` means "use the default": the core rebuilds the window KV exactly, giving the same
    outputs as a cold run. An int ``start`` with ``0 <= start <= num_cached_tokens`` means: keep the
    cached prefix below ``start`` and recompute tokens ``[start, num_cached_tokens)`` with the attention
    window truncated inside the recomputed segment (approximate window KV, e.g. bounded replay returns
    ``num_cached_tokens - sliding_window``); compressed entries below ``num_cached_tokens`` still come
    from the cache. ``start == 0`` recomputes every token. Any other value fails admission with
    ``PluginReturnError``.
    """


@hookspec(firstresult=True)
def deepinfer_restore_prefix_state(hit: PrefixHit, context: EngineContext | None) -> int | None:
    """Restore, instead of rebuilding, the per-sequence state (sliding windows, compressor carries) of a hit.

    Runs: in the scheduler, when a waiting request is admitted and the cache holds blocks of its first
    ``hit.num_cached_tokens`` tokens, after the engine's own prefix state cache (device memory,
    ``engine/prefix_state_cache.py``) found no state for the hit (when it restores, this hook is not called); before
    ``deepinfer_adopt_prefix_hit`` and ``deepinfer_rebuild_sliding_window``, which are not called when this hook
    restores. The first plugin that returns something other than ``None`` decides; later plugins are not called.

    Arguments:
    - ``hit``: the ``deepinfer_core.engine.prefix_replay.PrefixHit``; ``hit.block_hashes`` are the prefix-cache
      hashes of its blocks (``hit.block_hashes[k - 1]`` identifies the first ``k * block_size`` tokens).
    - ``context``: the engine's ``EngineContext``, or None for an engine built without one.

    Return: ``None`` (the default): nothing is restored. An int ``restored``, a positive multiple of
    ``hit.block_size`` with ``restored <= hit.num_cached_tokens``, promises that the plugin holds the
    request's exact per-sequence state after its first ``restored`` tokens and writes it into the request's slot
    (``request.slot``, known from ``deepinfer_before_step`` of the step that first runs the request) before that
    step runs: the request adopts those ``restored`` tokens and computes from there, reading the restored
    sliding window (outputs equal exact reuse). Any other value fails admission with ``PluginReturnError``.
    """


@hookspec(firstresult=True)
def deepinfer_first_chunk_end(request: Request, start: int, end: int, block_size: int,
                              context: EngineContext | None) -> int | None:
    """Choose where the first chunk of a request being admitted ends (e.g. on a block boundary, so that the step
    leaves the sequence's state there for a plugin to keep).

    Runs: in the scheduler, when a waiting request is admitted with a chunk ``[start, end)`` of more than one token
    (``start``: where computing starts after its prefix hit, if any; ``end``: as far as the step's token budget
    reaches). The first plugin that returns something other than ``None`` decides; later plugins are not called.

    Arguments:
    - ``request``: the engine's ``Request`` being admitted (``num_tokens``: every token it has).
    - ``start``, ``end``: the planned chunk.
    - ``block_size``: tokens per cache block.
    - ``context``: the engine's ``EngineContext``, or None for an engine built without one.

    Return: ``None`` keeps ``end``. An int with ``start < value <= end`` ends the chunk there (the rest is computed in
    later steps). Any other value fails admission with ``PluginReturnError``.
    """


# --- documentation -------------------------------------------------------------------------------

HOOK_REFERENCE_BEGIN = "<!-- BEGIN HOOK REFERENCE: generated by `python -m deepinfer_core.hookspecs --markdown` -->"
HOOK_REFERENCE_END = "<!-- END HOOK REFERENCE -->"


HOOK_ARGUMENT_TYPES: dict[str, str] = {
    "EngineContext": "deepinfer_core.engine_context",
    "OpTable": "deepinfer_core.ops.table",
    "ModelRegistry": "deepinfer_core.models.registry",
    "Engine": "deepinfer_core.engine.engine",
    "EngineConfig": "deepinfer_core.engine.engine",
    "SchedulerOutput": "deepinfer_core.engine.scheduler",
    "ScheduledChunk": "deepinfer_core.engine.scheduler",
    "Request": "deepinfer_core.engine.request",
    "PrefixHit": "deepinfer_core.engine.prefix_replay",
    "ModelRunnerOutput": "deepinfer_core.engine.model_runner",
    "LogitsRow": "deepinfer_core.sampling.logits_processor",
    "LogitsProcessor": "deepinfer_core.sampling.logits_processor",
    "ProposerRegistry": "deepinfer_core.spec_decode.proposer",
    "Proposer": "deepinfer_core.spec_decode.proposer",
    "DraftBatch": "deepinfer_core.spec_decode.proposer",
    "DraftSequence": "deepinfer_core.spec_decode.proposer",
    "Draft": "deepinfer_core.spec_decode.proposer",
    "SpeculativeConfig": "deepinfer_core.spec_decode.config",
}
"""The classes hook arguments are typed with (and the ones they lead to), by name -> module."""

ENGINE_ATTRIBUTES = ("config", "context", "tokenizer", "vocab_size", "eos_token_id", "num_steps", "model", "metrics")
"""What a plugin may read on the ``Engine`` the lifecycle hooks get (its methods drive the engine: not for plugins)."""


def hook_specs() -> list[Callable[..., object]]:
    """The hookspec functions of this module, in definition order."""
    module = sys.modules[__name__]
    specs = [
        fn
        for name, fn in vars(module).items()
        if name.startswith("deepinfer_") and inspect.isfunction(fn) and hasattr(fn, f"{PROJECT_NAME}_spec")
    ]
    return sorted(specs, key=lambda fn: fn.__code__.co_firstlineno)


def _spec_kind(fn: Callable[..., object]) -> str:
    opts = getattr(fn, f"{PROJECT_NAME}_spec")
    kinds = [kind for kind in ("firstresult", "historic") if opts.get(kind)]
    return ", ".join(kinds) if kinds else "broadcast (every implementation runs; results are collected)"


def render_markdown() -> str:
    """The hook reference in Markdown, built from the specs' signatures and docstrings."""
    lines = [
        HOOK_REFERENCE_BEGIN,
        "",
        f"Hook API version: **{HOOK_API_VERSION}** (declare `{PLUGIN_VERSION_ATTRIBUTE} = {HOOK_API_VERSION}`).",
        "",
    ]
    for fn in hook_specs():
        params = ", ".join(f"{name}: {p.annotation}" for name, p in inspect.signature(fn).parameters.items())
        lines += [f"### `{fn.__name__}({params})`", "", f"Kind: {_spec_kind(fn)}.", "", inspect.getdoc(fn), ""]
    lines += ["### Hook argument types", "",
              "The classes the hook arguments are typed with; fields first, then the public methods.", ""]
    for name, module in HOOK_ARGUMENT_TYPES.items():
        lines += _render_type(getattr(importlib.import_module(module), name), module)
    lines.append(HOOK_REFERENCE_END)
    return "\n".join(lines) + "\n"


def _render_type(cls: type, module: str) -> list[str]:
    """One argument type: its docstring's first paragraph, its fields (dataclasses) and its public methods."""
    doc = (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")
    lines = [f"#### `{module}.{cls.__name__}`", "", doc, ""]
    if dataclasses.is_dataclass(cls):
        lines += [f"- `{f.name}: {f.type}`" for f in dataclasses.fields(cls)]
    if cls.__name__ == "Engine":
        return [*lines, f"Read-only attributes for plugins: {', '.join(f'`{a}`' for a in ENGINE_ATTRIBUTES)}.", ""]
    members = [(n, m) for n, m in vars(cls).items() if not n.startswith("_") and callable(m) or isinstance(m, property)]
    for member_name, member in members:
        if member_name.startswith("_"):
            continue
        target = member.fget if isinstance(member, property) else member
        summary = (inspect.getdoc(target) or "").split("\n\n")[0].replace("\n", " ")
        shown = member_name if isinstance(member, property) else f"{member_name}{_signature(target)}"
        lines.append(f"- `{shown}`" + (f": {summary}" if summary else ""))
    return [*lines, ""]


def _signature(fn: Callable[..., object]) -> str:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return "(...)"
    return "(" + ", ".join(str(p) for p in params if p.name != "self") + ")"


def replace_reference(document: str) -> str:
    """``document`` with the text between the reference markers replaced by ``render_markdown()``."""
    start = document.find(HOOK_REFERENCE_BEGIN)
    end = document.find(HOOK_REFERENCE_END)
    if start < 0 or end < start:
        raise ValueError(
            f"document has no hook reference markers: add {HOOK_REFERENCE_BEGIN!r} ... {HOOK_REFERENCE_END!r}"
        )
    tail = document[end + len(HOOK_REFERENCE_END) :].removeprefix("\n")
    return document[:start] + render_markdown() + tail


def main(argv: list[str] | None = None) -> int:
    """``--markdown`` prints the hook reference; ``--write PATH`` updates it inside PATH, and the op catalogue
    (``deepinfer_core.ops.catalogue``) where PATH has its markers."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m deepinfer_core.hookspecs", description=main.__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--markdown", action="store_true", help="print the hook reference")
    group.add_argument("--write", metavar="PATH", help="replace the hook reference section inside PATH")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(render_markdown())
        return 0
    from deepinfer_core.ops.catalogue import CATALOGUE_BEGIN, replace_catalogue

    with open(args.write, encoding="utf-8") as f:
        document = replace_reference(f.read())
    if CATALOGUE_BEGIN in document:
        document = replace_catalogue(document)
    with open(args.write, "w", encoding="utf-8") as f:
        f.write(document)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``DeepInferError``, the base of every exception DeepInfer raises on purpose, and the errors at the core's edges.

Every message names what is wrong and what to do about it. Every exception class defined in the core or in an
installed backend or plugin distribution derives from ``DeepInferError``, so a caller can catch the whole family;
each also derives from the closest built-in so existing ``except ValueError`` / ``except LookupError`` code keeps
working. tests/test_errors.py walks the modules and checks this rule and the list below.

This module holds the errors at the core's edges (backends, plugins, options). The rest of the family lives
next to the code that raises it:

* ``deepinfer_core.checkpoint.CheckpointError`` (ValueError): a checkpoint folder that cannot be loaded;
* ``deepinfer_core.tokenizer.TokenizerError`` (ValueError): an unusable tokenizer folder or chat template;
* ``deepinfer_core.models.resolve.ModelNotFoundError`` (ValueError): no checkpoint folder for a model argument;
* ``deepinfer_core.models.registry.UnknownModelTypeError`` (ValueError): a ``model_type`` no loader handles;
* ``deepinfer_core.models.registry.ConfigFileError`` (ValueError): a config.json that is not a readable JSON object;
* ``deepinfer_core.models.registry.InvalidModelError`` (TypeError): a loaded model lacking part of the model interface;
* ``deepinfer_core.models.deepseek_v4.config.ConfigError`` (ValueError): a config.json this engine cannot run;
* ``deepinfer_core.ops.table.UnknownOpError`` (KeyError): an op override naming no op of the table;
* ``deepinfer_core.sampling.params.SamplingParamsTypeError`` (TypeError, ValueError): a wrongly typed parameter;
* ``deepinfer_core.sampling.structured_outputs.StructuredOutputsError`` (ValueError): a ``StructuredOutputsParams``
  without exactly one well-formed constraint;
* ``deepinfer_core.engine.input_processor.RequestRejectedError`` (ValueError): a request the engine refuses;
* ``deepinfer_core.engine_args.EngineArgsError`` (ValueError): an engine argument with a value it cannot take;
* ``deepinfer_core.sampling.logits_processor.LogitsProcessorError`` (RuntimeError): a logits processor that raised
  or returned logits of the wrong shape;
* ``deepinfer_core.cli.options.CommandLineOptionError`` (ValueError): a malformed ``--option NAME=VALUE``;
* ``deepinfer_core.bench.presets.PresetError`` (ValueError): an unknown or unbuildable benchmark preset;
* ``deepinfer_core.quant.writer.QuantizeError`` (ValueError): a checkpoint or recipe ``deepinfer quantize`` cannot use;
* ``deepinfer_core.spec_decode.config.SpeculativeConfigError`` (ValueError): a ``speculative_config`` (or
  ``DEEPINFER_USE_NEXTN_DECODE``) naming an unknown method or key, a bad ``num_speculative_tokens``, or a model that
  cannot roll back that many draft tokens;
* ``deepinfer_core.spec_decode.proposer.ProposerError`` (ValueError): a proposer registered wrongly, or drafts that
  break the proposer contract (too long, ids outside the vocabulary, ``draft_probs`` of the wrong shape);
* ``deepinfer_core.metrics.MetricError`` (ValueError): a metric asked for under a name taken by another kind;
* ``deepinfer_core.distributed.launcher.RankFailedError`` (RuntimeError): a rank of a data-parallel engine that
  raised, died or did not start in time (every rank is stopped);
* ``deepinfer_core.models.deepseek_v4.expert_parallel.PlacementError`` (ValueError): an expert placement (EPLB) that
  does not fit the sharded model.
"""

from __future__ import annotations


class DeepInferError(Exception):
    """Base class of every error the core raises on purpose."""


class UnknownBackendError(DeepInferError, LookupError):
    """A backend name that no installed distribution registers."""

    def __str__(self) -> str:  # LookupError would quote the message like a dict key otherwise
        return str(self.args[0]) if self.args else ""


class BackendUnavailableError(DeepInferError, RuntimeError):
    """An explicitly requested backend is installed but cannot run here; the message carries its probe reason."""


class InvalidBackendError(DeepInferError, TypeError):
    """A backend entry point or backend class breaks the backend contract (wrong return type, wrong base class)."""


class PluginError(DeepInferError):
    """A plugin could not be loaded or broke the hook contract."""


class PluginValidationError(PluginError, TypeError):
    """A plugin's hook implementations or declared hook API version do not match ``deepinfer_core.hookspecs``."""


class PluginHookError(PluginError, RuntimeError):
    """A plugin's hook implementation raised while the core called it; names the plugin, the hook and the original
    exception (also kept as ``__cause__`` and ``original``)."""

    plugin: str | None = None
    hook: str | None = None
    original: BaseException | None = None


class PluginReturnError(PluginError, ValueError):
    """A plugin's hook returned a value outside what the hook's spec allows (e.g. a prefix hit longer than the
    cache's)."""


class StrictPluginsError(PluginError, RuntimeError):
    """``DEEPINFER_STRICT_PLUGINS=1`` and some plugin failed to load."""


class UnknownOptionError(DeepInferError, ValueError):
    """A feature option that neither the core nor any loaded plugin claims."""


class UnsupportedBackendError(DeepInferError, ValueError):
    """An active plugin does not support the selected backend."""


class MissingDependencyError(DeepInferError, ImportError):
    """An option needs a package this environment lacks; the message names the option and how to install it."""


class EnvironmentVariableError(DeepInferError, ValueError):
    """A ``DEEPINFER_*`` environment variable holds a value its declaration (``deepinfer_core.envs``) does not accept."""

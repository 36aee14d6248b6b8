"""The plugin module the ``deepinfer.plugins`` entry point ``structured_output`` names.

It contributes one ``StructuredOutputProcessor`` per engine; the processor applies only to requests whose
``SamplingParams.structured_outputs`` is set, so every other request keeps its tokens bit for bit (and a step with
no constrained row keeps the greedy fast path). The plugin claims no option: installed, it is always active.
"""

from __future__ import annotations

from deepinfer_core.engine_context import EngineContext
from deepinfer_core.hookspecs import hookimpl
from deepinfer_structured_output.processor import StructuredOutputProcessor

DEEPINFER_HOOK_API_VERSION = 1
KEY = "structured_output"  # this plugin's entry in context.plugin_state: the engine's processor


@hookimpl
def deepinfer_feature_options() -> dict[str, str]:
    return {}  # no option: a request opts in through SamplingParams.structured_outputs


@hookimpl
def deepinfer_logits_processors(context: EngineContext):
    if context.tokenizer is None:  # requests with structured_outputs are then refused by the core
        return []
    vocab_size = (context.model_config or {}).get("vocab_size")
    processor = StructuredOutputProcessor.from_tokenizer(context.tokenizer, context.model_dir, vocab_size)
    context.plugin_state[KEY] = processor
    return [processor]

"""DeepInfer plugin: structured output (JSON schema, regex, choice, grammar) with llguidance."""

from deepinfer_structured_output.processor import StructuredOutputProcessor

__all__ = ["StructuredOutputProcessor"]

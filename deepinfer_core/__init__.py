"""DeepInfer, open: an inference engine for DeepSeek models (core package).

``from deepinfer_core import LLM, SamplingParams`` is the offline API (vLLM-compatible).
"""

from deepinfer_core.outputs import CompletionOutput, Logprob, RequestOutput

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # imported lazily so `deepinfer env` stays light
        from deepinfer_core.llm import LLM

        return LLM
    if name == "SamplingParams":
        # Lazy too: `deepinfer_core.sampling` imports torch, and the `deepinfer` CLI must be importable when
        # `import torch` fails (e.g. torch_npu installed without CANN) so it can print the fix (cli.main).
        from deepinfer_core.sampling.params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from deepinfer_core.sampling.structured_outputs import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module 'deepinfer_core' has no attribute {name!r}")


__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "StructuredOutputsParams",
           "__version__"]

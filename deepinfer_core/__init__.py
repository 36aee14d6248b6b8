"""DeepInfer, open: an inference engine for DeepSeek models (core package).

``from deepinfer_core import LLM, SamplingParams`` is the offline API (vLLM-compatible).
"""

from deepinfer_core.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer_core.sampling.params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # imported lazily so `deepinfer env` stays light
        from deepinfer_core.llm import LLM

        return LLM
    raise AttributeError(f"module 'deepinfer_core' has no attribute {name!r}")


__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "__version__"]

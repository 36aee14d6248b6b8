"""Offline inference with DeepInfer: a few prompts, one SamplingParams, print the completions.

Run it with no arguments to use the embedded default model (or ``$DEEPINFER_HF_MODEL_DIR``)::

    python examples/offline_inference.py
    python examples/offline_inference.py --model /path/to/deepseek-v4-checkpoint
"""

from __future__ import annotations

import argparse

from deepinfer_core import LLM, SamplingParams

PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef list_python_files(folder):",
    "class Stack:\n    def __init__(self):",
    "# Read a JSON file and return its content\n",
]


def main() -> None:
    """Load the model, generate one completion per prompt, print prompt and completion."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the embedded default model)")
    args = parser.parse_args()

    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=48)
    llm = LLM(model=args.model)
    outputs = llm.generate(PROMPTS, sampling_params)

    print("-" * 60)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt:    {prompt!r}\nGenerated: {generated_text!r}")
        print("-" * 60)


if __name__ == "__main__":
    main()

"""Where a test file's Triton kernels run: on the GPU, or, on a machine without one, in a child pytest process under
Triton's interpreter (``TRITON_INTERPRET=1``), started by the file's own ``*_under_triton_interpreter`` test."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
kernel_runs_here = pytest.mark.skipif(
    DEVICE == "cpu" and not INTERPRETED,
    reason="no GPU: runs in a child process under Triton's interpreter (the file's *_under_triton_interpreter test)")
starts_the_interpreter = pytest.mark.skipif(DEVICE == "cuda" or INTERPRETED,
                                            reason="the kernel runs directly on the GPU / in this process")


def run_under_interpreter(test_file: str, also_deselect: str = "") -> None:
    """Run ``test_file``'s tests (all but the one calling this, and ``also_deselect``, a ``-k`` expression) in a child
    pytest under Triton's interpreter; assert that they ran, none skipped, and passed."""
    selection = "not under_triton_interpreter" + (f" and not ({also_deselect})" if also_deselect else "")
    env = {**os.environ, "TRITON_INTERPRET": "1", "DEEPINFER_NVIDIA_COMPILE": "0"}
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", selection],
                           check=False, env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and "skipped" not in child.stdout, child.stdout[-2000:]

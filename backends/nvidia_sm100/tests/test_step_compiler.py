"""``compiled.StepCompiler``: decode steps compiled before capture while compiling works; after the first compiler
failure, steps are captured as they are (on the CPU: a TorchDynamo backend that raises stands in for a TorchInductor
failure such as Inductor's ``ValueError: ... is not comparable``; Dynamo wraps it as it wraps Inductor's)."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("triton", reason="the test extra installs triton")
from deepinfer_nvidia_sm100.kernels import compiled


def _step():
    x = torch.arange(6.0)

    def step():  # 31 when it ran compiled (``is_compiling`` is true while traced), 30 when it ran as it is
        return (x * 2).sum() + float(torch.compiler.is_compiling())

    return step


def _warm_capture(step):
    """What a graph runner does first: call the step (this compiles it), then keep it."""
    step()
    return step


def test_steps_are_compiled_while_compiling_works(monkeypatch):
    monkeypatch.setenv("DEEPINFER_NVIDIA_COMPILE_STEP", "1")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    steps = compiled.StepCompiler(backend)
    assert steps.capture(_step(), _warm_capture)() == 31.0
    assert len(graphs) == 1 and steps.failure is None


def test_a_compile_failure_captures_this_and_every_later_step_uncompiled(monkeypatch, caplog):
    monkeypatch.setenv("DEEPINFER_NVIDIA_COMPILE_STEP", "1")
    attempts = []

    def failing_backend(gm, example_inputs):
        attempts.append(gm)
        raise ValueError("The argument '(((-128))//32)' is not comparable.")

    torch._dynamo.reset()
    steps = compiled.StepCompiler(failing_backend)
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        assert steps.capture(_step(), _warm_capture)() == 30.0
    assert "not comparable" in steps.failure and "BackendCompilerFailed" in steps.failure
    assert "captured uncompiled" in caplog.text and "not comparable" in caplog.text  # with the traceback
    assert steps.capture(_step(), _warm_capture)() == 30.0
    assert len(attempts) == 1  # no second compile attempt


def test_switched_off_steps_are_never_compiled(monkeypatch):
    monkeypatch.setenv("DEEPINFER_NVIDIA_COMPILE_STEP", "0")
    assert compiled.StepCompiler(lambda gm, inputs: pytest.fail("compiled")).capture(_step(), _warm_capture)() == 30.0

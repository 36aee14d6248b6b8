"""``LoadWindow``: per-layer expert load summed over the last ``window_size`` engine steps, and the rebalance clock."""

from __future__ import annotations

import torch

from deepinfer_eplb.errors import EplbError


class LoadWindow:
    """A sliding window of per-step expert loads and a countdown of ``step_interval`` steps to the next rebalance.

    Each engine step hands ``record`` the tokens its router sent to each logical expert of each MoE layer
    (``[layers, num_experts]``); ``load()`` is the sum over the last ``window_size`` recorded steps (fewer until
    the window has filled). ``record`` returns True once ``step_interval`` steps have passed since the window was
    made or since the last ``mark_rebalanced()``. The window lives on ``device`` (the router's), so recording
    does not wait on the device.
    """

    def __init__(self, num_layers: int, num_experts: int, window_size: int, step_interval: int,
                 device: torch.device | str = "cpu"):
        for name, value in (("num_layers", num_layers), ("num_experts", num_experts), ("window_size", window_size),
                            ("step_interval", step_interval)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EplbError(f"LoadWindow: {name} must be a positive int, got {value!r}")
        self.window_size, self.step_interval = window_size, step_interval
        self._steps = torch.zeros(window_size, num_layers, num_experts, dtype=torch.int64, device=device)  # ring
        self._total = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)  # [layers, experts]
        self._next = 0  # ring position the next step overwrites
        self.num_recorded = 0  # steps recorded in all
        self.steps_since_rebalance = 0

    @property
    def shape(self) -> tuple[int, int]:
        """``(layers, num_experts)``."""
        return tuple(self._total.shape)

    def record(self, step_load: torch.Tensor) -> bool:
        """Add one step's load ``[layers, num_experts]`` (dropping the step that falls out of the window); return
        whether a rebalance is due."""
        if tuple(step_load.shape) != self.shape:
            raise EplbError(f"LoadWindow.record: step load must be [layers, num_experts] = {list(self.shape)}, "
                             f"got {list(step_load.shape)}")
        step_load = step_load.to(device=self._total.device, dtype=torch.int64)
        self._total += step_load - self._steps[self._next]
        self._steps[self._next] = step_load
        self._next = (self._next + 1) % self.window_size
        self.num_recorded += 1
        self.steps_since_rebalance += 1
        return self.due

    @property
    def due(self) -> bool:
        """Whether ``step_interval`` steps have passed since the window was made or last rebalanced."""
        return self.steps_since_rebalance >= self.step_interval

    def load(self) -> torch.Tensor:
        """Tokens per logical expert over the window: ``[layers, num_experts]`` int64 (a copy)."""
        return self._total.clone()

    def mark_rebalanced(self) -> None:
        """Restart the countdown (the window keeps its steps: the next plan still sees recent load)."""
        self.steps_since_rebalance = 0

"""``engine/gc_heap.py``: the engine's objects frozen out of Python's collections, and handed back at shutdown."""

from __future__ import annotations

import gc

from deepinfer_core.engine import gc_heap
from deepinfer_core.llm import LLM


def test_freeze_collects_then_exempts_survivors_and_the_knob_turns_it_off(monkeypatch):
    gc.unfreeze()
    survivor = [object() for _ in range(10)]
    assert gc_heap.freeze() is True
    frozen = gc.get_freeze_count()
    assert frozen >= len(survivor)
    monkeypatch.setenv(gc_heap.ENV, "0")
    more = [object() for _ in range(10)]
    assert gc_heap.freeze() is False and gc.get_freeze_count() == frozen
    gc_heap.unfreeze()
    assert gc.get_freeze_count() == 0 and len(more) == len(survivor)


def test_an_engine_freezes_its_heap_once_built_and_returns_it_at_shutdown():
    gc.unfreeze()
    llm = LLM(max_model_len=128)
    assert gc.get_freeze_count() > 0
    llm.engine.shutdown()
    assert gc.get_freeze_count() == 0

"""The plugin as the core loads it: the option, per-engine state, the hooks' answers."""

from __future__ import annotations

import pytest
from deepinfer_swa_replay import ReplayStats, SwaReplayOptionError, stats
from deepinfer_swa_replay.plugin import OPTION, parse_flag

from deepinfer_core.engine.prefix_replay import PrefixHit, PrefixReplay
from deepinfer_core.engine.request import Request
from deepinfer_core.engine_context import EngineContext
from deepinfer_core.plugins import configure_plugins, get_plugin_manager
from deepinfer_core.sampling.params import SamplingParams


def _request(num_tokens: int) -> Request:
    return Request(request_id="r", group_id="r", sample_index=0, prompt_token_ids=[5] * num_tokens,
                   params=SamplingParams(max_tokens=1), seed=0, arrival=0)


def _context(**options) -> EngineContext:
    return configure_plugins(get_plugin_manager(), context=EngineContext("cpu", options))


def test_the_entry_point_loads_and_claims_its_option():
    pm = get_plugin_manager()
    record = pm.records["swa_replay"]
    assert record.status == "loaded" and record.distribution == "deepinfer-swa-replay"
    assert {"deepinfer_adopt_prefix_hit", "deepinfer_rebuild_sliding_window"} <= set(record.hooks)


@pytest.mark.parametrize(("value", "on"), [(True, True), ("true", True), (1, True), ("off", False), (False, False)])
def test_option_values(value, on):
    assert parse_flag(value) is on
    assert isinstance(stats(_context(**{OPTION: value})), ReplayStats) is on


def test_a_bad_option_value_is_refused_naming_the_option():
    with pytest.raises(SwaReplayOptionError, match="enable_swa_replay must be a boolean.*'maybe'"):
        _context(**{OPTION: "maybe"})


def test_engines_without_the_option_keep_the_exact_rebuild():
    """Two engines in one process: the plugin acts only for the one configured with the option."""
    on, off = _context(**{OPTION: True}), _context()
    pm = get_plugin_manager()
    plans = {name: PrefixReplay(replay_span=768, sliding_window=128, plugin_manager=pm, context=ctx)
             .plan(_request(1024), 896, block_size=128) for name, ctx in (("on", on), ("off", off))}
    assert (plans["on"].adopted, plans["on"].start) == (768, 640)
    assert (plans["off"].adopted, plans["off"].start) == (896, 128)
    assert stats(on) == ReplayStats(hits_adopted=1, tokens_offered=896, tokens_adopted=768, tokens_replayed=128)
    assert stats(off) is None


def test_a_short_hit_is_dropped_and_counted():
    context = _context(**{OPTION: True})
    plan = PrefixReplay(768, 128, get_plugin_manager(), context).plan(_request(300), 256, block_size=128)
    assert (plan.adopted, plan.start) == (0, 0)
    assert stats(context).hits_dropped == 1


def test_hooks_answer_none_for_a_context_without_the_mode():
    pm = get_plugin_manager()
    hit = PrefixHit(_request(1024), 896, 128, 128, 768)
    assert pm.hook.deepinfer_adopt_prefix_hit(hit=hit, context=_context()) is None
    assert pm.hook.deepinfer_adopt_prefix_hit(hit=hit, context=None) is None

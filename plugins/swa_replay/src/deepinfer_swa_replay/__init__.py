"""deepinfer-swa-replay: SWA bounded replay for prefix-cache hits of DeepSeek-V4 models.

- ``BoundedReplay``: the adopted length of a hit (at most ``L - (window + 6)`` tokens, whole blocks, more than the
  window) and the replay start (``window`` tokens before it);
- the ``enable_swa_replay`` feature option (``plugin``): ``LLM(..., enable_swa_replay=True)``; ``stats(llm.context)``
  gives that engine's ``ReplayStats``;
- ``measure``: a ``ReplayAccuracy`` of bounded replay against exact reuse on given prompts;
- the SWA host cache (``host_cache_plugin``, entry point ``swa_host_cache``): ``LLM(..., enable_swa_host_cache=True)``
  keeps sequences' window state at block boundaries in host memory (``SwaHostCache``) and restores a prefix hit from
  it exactly; ``host_cache_stats(llm.context)`` gives its counters.
"""

from deepinfer_swa_replay.accuracy import ReplayAccuracy, measure
from deepinfer_swa_replay.errors import SwaHostCacheError, SwaHostCacheOptionError, SwaReplayError, SwaReplayOptionError
from deepinfer_swa_replay.host_cache import SwaHostCache
from deepinfer_swa_replay.host_cache_plugin import host_cache_stats
from deepinfer_swa_replay.plugin import stats
from deepinfer_swa_replay.policy import ROLLBACK_TOKENS, BoundedReplay
from deepinfer_swa_replay.stats import ReplayStats

__all__ = ["ROLLBACK_TOKENS", "BoundedReplay", "ReplayAccuracy", "ReplayStats", "SwaHostCache", "SwaHostCacheError",
           "SwaHostCacheOptionError", "SwaReplayError", "SwaReplayOptionError", "host_cache_stats", "measure", "stats"]

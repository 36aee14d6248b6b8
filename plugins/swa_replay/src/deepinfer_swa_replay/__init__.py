"""deepinfer-swa-replay: SWA bounded replay for prefix-cache hits of DeepSeek-V4 models.

- ``BoundedReplay``: the adopted length of a hit (at most ``L - (window + 6)`` tokens, whole blocks, more than the
  window) and the replay start (``window`` tokens before it);
- the ``enable_swa_replay`` feature option (``plugin``): ``LLM(..., enable_swa_replay=True)``; ``stats(llm.context)``
  gives that engine's ``ReplayStats``;
- ``measure``: a ``ReplayAccuracy`` of bounded replay against exact reuse on given prompts.
"""

from deepinfer_swa_replay.accuracy import ReplayAccuracy, measure
from deepinfer_swa_replay.errors import SwaReplayError, SwaReplayOptionError
from deepinfer_swa_replay.plugin import stats
from deepinfer_swa_replay.policy import ROLLBACK_TOKENS, BoundedReplay
from deepinfer_swa_replay.stats import ReplayStats

__all__ = ["ROLLBACK_TOKENS", "BoundedReplay", "ReplayAccuracy", "ReplayStats", "SwaReplayError",
           "SwaReplayOptionError", "measure", "stats"]

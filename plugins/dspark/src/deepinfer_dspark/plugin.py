"""The ``deepinfer.plugins`` entry point ``dspark``: the ``mtp`` and ``dspark`` speculative-decoding methods.

``LLM(model, speculative_config={"method": "dspark", "num_speculative_tokens": 5})`` (or
``DEEPINFER_USE_NEXTN_DECODE=5``, as in the reference engine) drafts with the checkpoint's MTP layers and verifies
a confidence-scheduled share of the drafts; ``"method": "mtp"`` verifies every draft token (for comparison).
``dspark`` takes ``num_verify_tokens`` (draft tokens verified per step across the batch) or ``verify_fraction``
(that budget as a fraction of sequences x ``num_speculative_tokens``, default 0.75). Every backend: the draft runs
through the target's op table.
"""

from __future__ import annotations

from deepinfer_core.hookspecs import hookimpl
from deepinfer_dspark.proposer import DSPARK_KEYS, DSparkProposer, MtpProposer

DEEPINFER_HOOK_API_VERSION = 1


@hookimpl
def deepinfer_register_proposers(registry, context) -> None:
    """Register ``mtp`` (fixed k) and ``dspark`` (confidence-scheduled verification)."""
    registry.register("mtp", MtpProposer)
    registry.register("dspark", DSparkProposer, keys=DSPARK_KEYS)

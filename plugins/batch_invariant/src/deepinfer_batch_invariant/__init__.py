"""deepinfer-batch-invariant: bitwise identical logits for a request whatever else is in the batch.

Enable with ``LLM(..., batch_invariant=True)`` or ``DEEPINFER_BATCH_INVARIANT=1``; see ``plugin`` for how
the mode is decided per engine and ``cpu_ops`` for the op variants.
"""

from deepinfer_batch_invariant.plugin import ENV, ENV_MTP_VARLEN, OPTION, State, reset, state

__all__ = ["ENV", "ENV_MTP_VARLEN", "OPTION", "State", "reset", "state"]

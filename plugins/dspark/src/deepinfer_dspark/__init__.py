"""deepinfer-dspark: DSpark speculative decoding for DeepSeek-V4 checkpoints with MTP draft layers.

- ``MtpProposer`` (method ``"mtp"``): fixed-k drafts from the checkpoint's ``mtp.K.*`` layers;
- ``DSparkProposer`` (method ``"dspark"``): the same drafts, verified by confidence-scheduled allocation of a
  per-step token budget (``allocate_verification``);
- ``allocate_verification`` / ``expected_accepted``: the allocation and its objective.
"""

from deepinfer_dspark.allocation import allocate_verification, expected_accepted
from deepinfer_dspark.errors import DSparkError
from deepinfer_dspark.proposer import DSparkProposer, MtpProposer

__all__ = ["DSparkError", "DSparkProposer", "MtpProposer", "allocate_verification", "expected_accepted"]

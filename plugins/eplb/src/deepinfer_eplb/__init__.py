"""deepinfer-eplb: expert-parallel load balancing for DeepSeek MoE models.

- ``rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)``: deepseek-ai/EPLB's placement
  (hierarchical when the groups divide over the nodes, global otherwise), returning a ``Placement``
  ``(phy2log, log2phy, logcnt)``;
- ``LoadWindow``: per-layer expert load over a sliding window of steps, and when to rebalance;
- ``moe_lb`` / ``rank_loads``: the balance figure of a placement (busiest rank's load / mean rank load);
- ``ExpertBalancer``: one engine's window, placement and rebalance reports; ``plan_transfers``: the weight copies
  between two placements;
- the ``enable_eplb`` / ``eplb_config`` feature options (``plugin``, ``EplbConfig``).
"""

from deepinfer_eplb.balance import layer_balance, moe_lb, rank_loads
from deepinfer_eplb.balancer import ExpertBalancer, RebalanceReport
from deepinfer_eplb.config import EplbConfig
from deepinfer_eplb.errors import EplbConfigError, EplbError
from deepinfer_eplb.load_window import LoadWindow
from deepinfer_eplb.migration import Transfer, plan_transfers
from deepinfer_eplb.packing import balanced_packing
from deepinfer_eplb.placement import Placement
from deepinfer_eplb.rebalance import rebalance_experts
from deepinfer_eplb.replication import replicate_experts

__all__ = ["EplbConfig", "EplbConfigError", "EplbError", "ExpertBalancer", "LoadWindow", "Placement",
           "RebalanceReport", "Transfer", "balanced_packing", "layer_balance", "moe_lb", "plan_transfers",
           "rank_loads", "rebalance_experts", "replicate_experts"]

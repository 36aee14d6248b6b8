"""CONTRACT tests (CPU, not hardware): MoE routing and experts through torch_npu's MoE ops.

torch_npu is replaced by ``contract_reference`` (npu_moe_gating_top_k, npu_moe_init_routing,
npu_moe_compute_expert_tokens, npu_grouped_matmul, npu_moe_finalize_routing as documented, in plain torch);
the adapters are compared with ``deepinfer_core.ops.reference``.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.ops import reference


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
def test_contract_route_topk_matches_reference(npu_ops, scoring):
    logits = torch.randn(9, 16, generator=_gen())
    bias = 0.3 * torch.randn(16, generator=_gen(1))
    got_w, got_ids = npu_ops.moe_route_topk(logits, bias, 4, 1.5, scoring)
    want_w, want_ids = reference.moe_route_topk(logits, bias, 4, 1.5, scoring)
    assert got_ids.dtype == torch.long and torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w)


def test_contract_route_topk_ties_go_to_the_lower_expert(npu_ops):
    logits = torch.zeros(2, 8)  # every score equal
    _, ids = npu_ops.moe_route_topk(logits, torch.zeros(8), 3, 1.0, "sigmoid")
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]


def test_contract_sqrtsoftplus_routing_uses_the_reference(npu_ops, stand_in, monkeypatch):
    """DeepSeek-V4 scores with sqrtsoftplus; npu_moe_gating_top_k documents softmax and sigmoid only."""
    monkeypatch.setattr(stand_in, "npu_moe_gating_top_k", lambda *a, **k: pytest.fail("sqrtsoftplus reached the op"))
    logits, bias = torch.randn(5, 8, generator=_gen()), torch.randn(8, generator=_gen(1))
    got = npu_ops.moe_route_topk(logits, bias, 2, 1.5, "sqrtsoftplus")
    want = reference.moe_route_topk(logits, bias, 2, 1.5, "sqrtsoftplus")
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _experts(num_experts, dim, inter, dtype, seed=2):
    gen = _gen(seed)
    w1 = (0.3 * torch.randn(num_experts, inter, dim, generator=gen)).to(dtype)
    w2 = (0.3 * torch.randn(num_experts, dim, inter, generator=gen)).to(dtype)
    w3 = (0.3 * torch.randn(num_experts, inter, dim, generator=gen)).to(dtype)
    return w1, w2, w3


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_contract_moe_experts_matches_reference(npu_ops, dtype, tol):
    tokens, top_k, experts, dim, inter = 11, 2, 6, 16, 8
    x = torch.randn(tokens, dim, generator=_gen()).to(dtype)
    ids = torch.stack([torch.randperm(experts - 1, generator=_gen(10 + t))[:top_k] for t in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=_gen(3))  # fp32 router weights; expert 5 gets no token
    w1, w2, w3 = _experts(experts, dim, inter, dtype)
    got = npu_ops.moe_experts(x, ids, weights, w1, w2, w3, 1.0)
    want = reference.moe_experts(x, ids, weights, w1, w2, w3, 1.0)
    assert got.dtype == x.dtype
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_contract_moe_experts_without_tokens(npu_ops):
    w1, w2, w3 = _experts(4, 8, 4, torch.float32)
    x = torch.zeros(0, 8)
    got = npu_ops.moe_experts(x, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), w1, w2, w3, 1.0)
    assert got.shape == (0, 8)


def test_contract_init_routing_stand_in_follows_the_documented_example(stand_in):
    """The torch_npu doc's example (x 3 rows, k 2), worked by hand from the documented formula."""
    x = torch.tensor([[0.1] * 4, [0.2] * 4, [0.3] * 4])
    row_idx = torch.tensor([[0, 3], [1, 4], [2, 5]], dtype=torch.int32)
    expert_idx = torch.tensor([[1, 2], [0, 1], [0, 2]], dtype=torch.int32)
    expanded_x, expanded_row_idx, expanded_expert_idx = stand_in.npu_moe_init_routing(x, row_idx, expert_idx, 3)
    assert expanded_expert_idx.tolist() == [0, 0, 1, 1, 2, 2]
    assert expanded_row_idx.tolist() == [2, 0, 1, 4, 3, 5]
    torch.testing.assert_close(expanded_x, x[[1, 2, 0, 1, 0, 2]])


def test_contract_stand_ins_reject_undocumented_calls(stand_in):
    """The stand-ins enforce documented constraints; an adapter that broke one would fail loudly."""
    with pytest.raises(stand_in.ContractViolation):
        stand_in.npu_moe_gating_top_k(torch.randn(2, 4), 1, bias=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(stand_in.ContractViolation):
        stand_in.npu_rms_norm(torch.randn(4), torch.ones(4))
    with pytest.raises(stand_in.ContractViolation):
        q = torch.randn(1, 2, 4, 32, dtype=torch.bfloat16)
        stand_in.npu_fused_infer_attention_score_v2(q, q, q, num_query_heads=4, input_layout="BSND",
                                                    learnable_sink=torch.zeros(4, dtype=torch.bfloat16))

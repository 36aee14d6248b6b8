"""The MXFP4 experts on fp8 tensor cores (``kernels/moe_mxfp4_fp8_decode.py``) and their e4m3 expansion
(``dequant.e4m3_codes``): the expansion exact on every byte, a program's product exact against the exactly decoded
weights times the quantized activations, the op against an emulation of its math and against the reference op; on
the GPU where there is one, else in a child pytest under Triton's interpreter (fp16 activations: it has no bf16);
and compiled for sm_90a / sm_100a with the inline PTX, without spills, in fewer instructions a weight than
``moe_mxfp4_decode``."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="the test extra installs triton")
import triton.language as tl
from deepinfer_nvidia_sm100.kernels import dequant, fp8_linear, moe_mxfp4_fp8_decode, moe_quant
from interpreted import DEVICE, kernel_runs_here, run_under_interpreter, starts_the_interpreter

from deepinfer_core.ops import reference as ref
from deepinfer_core.quant import mxfp4

DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16
PTX = [False, True] if DEVICE == "cuda" else [False]
LIMIT = 7.0


@starts_the_interpreter
def test_kernels_under_triton_interpreter():
    run_under_interpreter(__file__, also_deselect="compile or fewer_instructions")


@triton.jit
def _codes_kernel(packed_ptr, low_ptr, high_ptr, PTX: tl.constexpr):
    i = tl.arange(0, 256)
    low, high = dequant.e4m3_codes(tl.load(packed_ptr + i), PTX)
    tl.store(low_ptr + i, low)
    tl.store(high_ptr + i, high)


@kernel_runs_here
@pytest.mark.parametrize("ptx", PTX)
def test_e4m3_codes_are_every_code_times_a_64th(ptx):
    packed = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    low, high = (torch.empty(256, dtype=torch.float8_e4m3fn, device=DEVICE) for _ in range(2))
    _codes_kernel[(1,)](packed, low, high, PTX=ptx)
    codes = mxfp4.dequantize(packed.view(16, 16).cpu(), torch.full((16, 1), 127, dtype=torch.uint8).view(
        torch.float8_e8m0fnu)).reshape(256, 2)  # [byte, (low, high)] at scale 1
    assert torch.equal(low.float().cpu() * 64, codes[:, 0]) and torch.equal(high.float().cpu() * 64, codes[:, 1])


def _quantized_rows(t: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [R, K]`` per ``block`` inputs as e4m3 and float32 scales (``amax / 448``): torch's own rounding."""
    blocks = t.float().reshape(t.shape[0], -1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (blocks / scale).to(torch.float8_e4m3fn).reshape(t.shape), scale[..., 0]


def _pairs_split(q: torch.Tensor) -> torch.Tensor:
    """``q [R, K]`` with each 32 inputs' even ones first (``fp8_linear.pairs_split_order``)."""
    return q.reshape(q.shape[0], -1, 16, 2).transpose(-1, -2).reshape(q.shape)


@triton.jit
def _product_kernel(a_ptr, as_ptr, w_ptr, s_ptr, out_ptr, K, BLOCK_M: tl.constexpr, HALF: tl.constexpr,
                    A_BLOCK: tl.constexpr, PTX: tl.constexpr):
    rows = tl.arange(0, HALF).to(tl.int64)
    m = tl.arange(0, BLOCK_M).to(tl.int64)
    w_top, s_top = w_ptr + rows * (K // 2), s_ptr + rows * (K // 32)
    acc = moe_mxfp4_fp8_decode._product(a_ptr + m * K, as_ptr + m * (K // A_BLOCK), w_top, w_top + HALF * (K // 2),
                                        s_top, s_top + HALF * (K // 32), K, BLOCK_M, HALF, A_BLOCK, PTX)
    tl.store(out_ptr + tl.arange(0, 2 * HALF)[:, None] * BLOCK_M + m[None, :], acc)


@kernel_runs_here
@pytest.mark.parametrize("a_block", [128, 64])
@pytest.mark.parametrize("ptx", PTX)
def test_a_programs_product_is_the_exact_weights_times_the_quantized_activations(ptx, a_block):
    """``_product`` over 256 inputs for 128 weight rows and 16 activation rows, scale bytes from 2^-27 to 2^22, two
    all-zero activation blocks, activation scales per 128 inputs (``x``) or 64 (``h``): the decoded weights
    (``mxfp4.dequantize``) times the e4m3 activations and their scales, up to float32 summation."""
    gen = torch.Generator().manual_seed(0)
    K, half, bm = 256, 64, 16
    packed = torch.randint(0, 256, (2 * half, K // 2), dtype=torch.uint8, generator=gen)
    scale_bytes = torch.randint(100, 150, (2 * half, K // 32), dtype=torch.uint8, generator=gen)
    x = torch.randn(bm, K, generator=gen) * torch.exp2(torch.randint(-8, 8, (bm, 1), generator=gen).float())
    x[3, :128] = 0
    x[7, 128:] = 0
    q, s = _quantized_rows(x, a_block)
    out = torch.empty(2 * half, bm, dtype=torch.float32, device=DEVICE)
    _product_kernel[(1,)](_pairs_split(q).to(DEVICE), s.to(DEVICE), packed.to(DEVICE), scale_bytes.to(DEVICE), out, K,
                          BLOCK_M=bm, HALF=half, A_BLOCK=a_block, PTX=ptx, num_warps=4)
    weights = mxfp4.dequantize(packed, scale_bytes.view(torch.float8_e8m0fnu)).double()  # [2H, K]
    acts = q.double() * s.double().repeat_interleave(a_block, dim=1)  # [BM, K]
    want = weights @ acts.T
    bound = (weights.abs() @ acts.abs().T) * 2.0**-20  # float32 sums of 256 exact products
    assert ((out.cpu().double() - want).abs() <= bound).all()


def _experts(E: int, D: int, I: int, gen: torch.Generator):
    stored = []
    for rows, cols in ((I, D), (D, I), (I, D)):
        stored += mxfp4.quantize(torch.randn(E, rows, cols, generator=gen) * cols**-0.5)
    return stored


def _emulated(x, ids, weights, w1, s1, w2, s2, w3, s3) -> torch.Tensor:
    """The op's math in float64 on the exactly decoded weights: ``x`` quantized per 128 inputs and each expert's
    SwiGLU output (rounded to the activations' dtype) per ``HALF``, the picks added in float64."""
    w1, w2, w3 = (mxfp4.dequantize(w, s).double() for w, s in ((w1, s1), (w2, s2), (w3, s3)))

    def q(t, block):
        values, scales = _quantized_rows(t, block)
        return values.double() * scales.double().repeat_interleave(block, dim=1)

    out = torch.zeros(x.shape, dtype=torch.float64)
    xq = q(x, 128)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            gate = (xq[t] @ w1[e].T).to(x.dtype).double().clamp(max=LIMIT)
            up = (xq[t] @ w3[e].T).to(x.dtype).double().clamp(-LIMIT, LIMIT)
            h = (torch.nn.functional.silu(gate) * up).to(x.dtype)
            out[t] += weights[t, j].double() * (q(h[None], moe_mxfp4_fp8_decode.HALF)[0] @ w2[e].T)
    return out


@kernel_runs_here
@pytest.mark.parametrize("tokens", [1, 6, 40])
def test_the_op_matches_its_emulation_and_the_reference_op(tokens):
    """One token (batch-1 decode), a few, and enough for several blocks of one expert; a token picking one expert
    twice. Against the emulation of its own math within 3% of the largest output (float32 against float64 sums: an
    element of ``h`` may round to the next e4m3 value, 1/8 apart); against the reference op (bf16 activations) within
    10%: the activations' quantization."""
    gen = torch.Generator().manual_seed(tokens)
    E, top_k, D, I = 8, 3, 256, 256
    x = torch.randn(tokens, D, generator=gen).to(DTYPE)
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(tokens)])
    if tokens > 1:
        ids[1, -1] = ids[1, 0]
    weights = torch.rand(tokens, top_k, generator=gen)
    experts = _experts(E, D, I, gen)
    stored = [t.view(torch.uint8).to(DEVICE) for t in experts]
    got = moe_mxfp4_fp8_decode.run(x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), *stored, LIMIT).cpu().double()
    want = _emulated(x, ids, weights, *experts)
    peak = want.abs().max()
    assert (got - want).abs().max() <= 0.03 * peak
    reference = ref.moe_experts_mxfp4(x.float(), ids, weights, *experts, LIMIT).double()
    assert (got - reference).abs().max() <= 0.1 * peak


@kernel_runs_here
def test_the_mxfp4_op_takes_these_kernels_only_when_switched_on(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    E, top_k, D, I = 4, 2, 256, 128
    x = torch.randn(3, D, generator=gen).to(DTYPE).to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(3)]).to(DEVICE)
    weights = torch.rand(3, top_k, generator=gen).to(DEVICE)
    stored = [t.to(DEVICE) for t in _experts(E, D, I, gen)]
    fp8 = moe_mxfp4_fp8_decode.run(x, ids, weights, *(t.view(torch.uint8) for t in stored), LIMIT)
    monkeypatch.setattr(moe_mxfp4_fp8_decode, "ENABLED", True)
    assert torch.equal(moe_quant.moe_experts_mxfp4(x, ids, weights, *stored, LIMIT), fp8)
    monkeypatch.setattr(moe_mxfp4_fp8_decode, "ENABLED", False)
    assert not torch.equal(moe_quant.moe_experts_mxfp4(x, ids, weights, *stored, LIMIT), fp8)


def test_the_quantized_activations_are_stored_pairs_split():
    k = torch.arange(64)
    order = [int(fp8_linear.pairs_split_order.fn(i)) for i in k.tolist()]
    assert order[:4] == [0, 16, 1, 17] and order[31] == 31 and order[32:34] == [32, 48]
    assert sorted(order) == k.tolist()


def _types() -> dict[str, str]:
    return {**{f"{p}{i}_ptr": "*u8" for p in "ws" for i in "123"}, "assign_ptr": "*i64", "block_expert_ptr": "*i64",
            "weights_ptr": "*fp32", "limit": "fp32", "xq_ptr": "*fp8e4nv", "hq_ptr": "*fp8e4nv", "xs_ptr": "*fp32",
            "hs_ptr": "*fp32"}


@pytest.mark.parametrize("capability", [90, 100])
@pytest.mark.parametrize("kernel", ["_up_kernel", "_down_kernel"])
def test_kernels_compile_with_the_inline_ptx_on_the_tensor_cores(kernel, capability):
    """Compiled for sm_90a / sm_100a as the JIT sees the preset (ptxas accepts the expansion's assembly): fp8
    products, no local-memory spills."""
    from deepinfer_nvidia_sm100.kernels import aot

    _, block_m, stages = moe_mxfp4_fp8_decode.TILES[0]
    constants = {"BLOCK_M": block_m, "HALF": moe_mxfp4_fp8_decode.HALF, "PTX": True} | (
        {"DT": tl.bfloat16} if kernel == "_up_kernel" else {})
    ptx = aot.compile_divisible(getattr(moe_mxfp4_fp8_decode, kernel), _types(), constants, capability,
                                moe_mxfp4_fp8_decode.WARPS, stages).asm["ptx"]
    assert "shr.b32" in ptx and "ld.local" not in ptx and "st.local" not in ptx, kernel
    if capability == 90:
        assert "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3" in ptx, kernel


@pytest.mark.parametrize("kernel, most", [("_up_kernel", 3.7), ("_down_kernel", 4.0)])
def test_the_loop_issues_fewer_instructions_a_weight_than_moe_mxfp4_decode(kernel, most):
    """Static count on sm_90a (``benchmarks/sass_census.py``): at the default tile the K loops issue 3.50 / 3.78
    instructions a weight (Triton 3.9), against 4.27 / 3.90 for ``moe_mxfp4_decode``'s decode tile; no spills."""
    from deepinfer_nvidia_sm100.kernels import aot

    _, block_m, stages = moe_mxfp4_fp8_decode.TILES[0]
    half, warps = moe_mxfp4_fp8_decode.HALF, moe_mxfp4_fp8_decode.WARPS
    constants = {"BLOCK_M": block_m, "HALF": half, "PTX": True} | ({"DT": tl.bfloat16} if kernel == "_up_kernel" else {})
    compiled = aot.compile_divisible(getattr(moe_mxfp4_fp8_decode, kernel), _types(), constants, 90, warps, stages)
    counts, spills = aot.loop_census(aot.disassemble(compiled.asm["cubin"]))
    per_weight = sum(counts.values()) * warps * 32 / (2 * half * moe_mxfp4_fp8_decode.STEP)
    assert spills == 0 and per_weight < most, per_weight

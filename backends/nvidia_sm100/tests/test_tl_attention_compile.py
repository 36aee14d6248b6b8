"""Compile-only checks of the TileLang kernels (run on the CPU CI machine: no GPU needed).

Each kernel is lowered by TileLang for sm_90a and sm_100a; the generated CUDA must use Hopper's wgmma
(sm_90a) / Blackwell's tcgen05 MMA with tensor-memory accumulators (sm_100a), and nvcc must compile it to a
cubin for that arch. Skipped, with the reason, where TileLang (the ``tilelang`` extra) or nvcc is missing.
"""

import shutil
import struct

import pytest

tilelang = pytest.importorskip("tilelang", reason="TileLang not installed (pip install 'deepinfer-nvidia-sm100[tilelang]')")
NVCC = shutil.which("nvcc")


@pytest.fixture(scope="module")
def sources():
    from deepinfer_nvidia_sm100.kernels import tl_attention as tla

    cache = {}

    def get(arch, which):
        if (arch, which) not in cache:
            cache[arch, which] = tla.generated_source(arch, "bfloat16", which)
        return cache[arch, which]

    return get


def test_sm90_attention_uses_wgmma(sources):
    src = sources("sm_90a", "split")
    assert "tl::wgmma_ss<" in src  # both GEMMs: Q K^T and P V, shared-memory operands
    assert src.count("tl::wgmma_ss<") >= 2
    assert "tcgen05" not in src


def test_sm90_whole_row_attention_uses_wgmma_and_writes_the_output(sources):
    """Rows of one key split skip the partials and the combine pass: the kernel writes ``Out`` in bf16."""
    src = sources("sm_90a", "whole")
    assert src.count("tl::wgmma_ss<") >= 2
    assert "bfloat16_t* __restrict__ Out" in src and "Opart" not in src


def test_sm100_attention_uses_tcgen05_with_tmem(sources):
    src = sources("sm_100a", "split")
    assert "tcgen05mma" in src  # TCGEN5 MMA issue
    assert "tmem_allocate" in src and "tcgen05_ld" in src  # accumulators in tensor memory, read back by tcgen05.ld
    assert "wgmma" not in src


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH (CI has nvcc 13.0 at /usr/local/bin/nvcc)")
@pytest.mark.parametrize("arch, which", [("sm_90a", "split"), ("sm_90a", "combine"), ("sm_90a", "whole"),
                                         ("sm_100a", "split"), ("sm_100a", "combine")])
def test_attention_compiles_with_nvcc(sources, arch, which):
    from deepinfer_nvidia_sm100.kernels import tl_attention as tla

    cubin = tla.compile_source(sources(arch, which), arch)
    assert cubin[:4] == b"\x7fELF" and cubin[4] == 2  # 64-bit ELF
    e_flags = struct.unpack_from("<I", cubin, 48)[0]  # CUDA ELF (ABI v8): SM version in bits 8..15
    assert (e_flags >> 8) & 0xFF == int(arch[3:-1])


@pytest.mark.parametrize("S, Lq, Lk, H, splits, sparse", [(1, 1, 40, 4, 1, False), (3, 1, 70, 4, 3, False),
                                                         (2, 5, 33, 8, 2, False), (2, 6, 150, 4, 2, True),
                                                         (1, 3, 100, 4, 1, True)])
def test_kernel_logic_on_tilelang_cpu_target(S, Lq, Lk, H, splits, sparse):
    """The split + combine algorithm (mask, zero fill past Lk, sink once in the denominator, split merge, empty
    splits, fully masked rows, rows that see only some key blocks: the visible-block lists) through TileLang's C
    target, against the reference op."""
    import torch
    from deepinfer_nvidia_sm100.kernels import tl_attention as tla

    from deepinfer_core.ops import reference as ref

    g = torch.Generator().manual_seed(S * 100 + Lk)
    d = 32
    q = torch.randn(S, Lq, H, d, generator=g)
    kv = torch.randn(S, Lk, d, generator=g)
    visible = torch.rand(S, Lq, Lk, generator=g) < 0.6
    if sparse:  # each row sees ~30% of the 16-key blocks
        blocks = torch.rand(S, Lq, -(-Lk // 16), generator=g) < 0.3
        visible &= blocks.repeat_interleave(16, dim=-1)[..., :Lk]
    visible[0, 0] = False  # nothing visible -> 0
    sinks = torch.randn(H, generator=g) * 2
    got = tla.sink_attention_cpu(q, kv, visible, sinks, d**-0.5, splits=splits, block_n=16)
    want = ref.sink_attention(q, kv, visible, sinks, d**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got[0, 0].abs().max().item() == 0.0


def test_split_heuristic_and_switch(monkeypatch):
    """One wave of CTAs at most (one per SM), >= 2 key blocks per split; env overrides."""
    from deepinfer_nvidia_sm100.kernels import tl_attention as tla

    assert tla.num_splits(64, 2048, 132) == 2  # 128 CTAs; 3 splits (192 CTAs) would start a second, partial wave
    assert tla.num_splits(16, 2048, 132) == 8
    assert tla.num_splits(1, 2048, 132) == 16  # 32 key blocks, 2 per split
    assert tla.num_splits(512, 320, 132) == 1
    monkeypatch.setenv("DEEPINFER_TL_ATTN_SPLITS", "4")
    assert tla.num_splits(64, 2048, 132) == 4
    assert tla.available()
    monkeypatch.setenv("DEEPINFER_NVIDIA_TILELANG", "0")
    assert not tla.available()

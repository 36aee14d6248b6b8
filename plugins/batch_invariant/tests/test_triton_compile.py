"""Every Triton kernel of the CUDA variants compiles for sm_90a and sm_100a, as the ops launch it (no GPU).

The ops run once on small CPU inputs under Triton's interpreter (conftest sets ``TRITON_INTERPRET=1`` on a
machine without a GPU); every distinct launch (kernel, argument types, constexprs, warps, stages) is recorded and
then compiled ahead of time with Triton's own ptxas for ``GPUTarget("cuda", 90)`` and ``("cuda", 100)``, with
the GPU code path (``EMULATE=False``). Block sizes that follow the input shape are those of these small inputs;
the GEMM tiles are the production ones (fixed per dtype, and the prefill tile). Checked: the PTX targets the architecture and a cubin
comes out; the bf16 GEMM tile (64 rows) uses wgmma on sm_90a and tcgen05 on sm_100a. Results on the GPU are
checked by test_cuda.py (marker ``nvidia``); nothing here ran on an SM100 GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton", reason="the test extra installs triton")
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("records launches under Triton's interpreter, for machines without a GPU",
                allow_module_level=True)

from bi_harness import _indexer_sequence, attention_batch, row_cases
from deepinfer_batch_invariant import triton_kernels
from deepinfer_batch_invariant.ops import implementations

ARCHS = {90: ("sm_90a", "wgmma"), 100: ("sm_100a", "tcgen05.mma")}
POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int64: "*i64",
                 torch.int32: "*i32", torch.uint8: "*u8", torch.bool: "*i1"}
LAUNCH_OPTIONS = ("num_warps", "num_stages")


def _record_launches() -> dict[tuple, tuple]:
    """Run every variant once on small inputs; returns the distinct launches: key -> (python fn, args, kwargs)."""
    launches: dict[tuple, tuple] = {}
    kernel_type = type(triton_kernels._matmul_nt_kernel)
    original = kernel_type.__getitem__

    def recording(self, grid):
        launch = original(self, grid)

        def run(*args, **kwargs):
            types = tuple(_arg_type(a) for a in args)
            launches.setdefault((self.fn.__name__, types, tuple(sorted(kwargs.items()))), (self.fn, args, kwargs))
            return launch(*args, **kwargs)
        return run

    ops = implementations("nvidia_sm100")
    gen = torch.Generator().manual_seed(0)
    kernel_type.__getitem__ = recording
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for case in row_cases(dtype):
                case.call(ops[case.op], case.rows(5, gen))
            q, kv, visible, sinks, scale = attention_batch(gen, dtype=dtype)
            ops["sink_attention"](q, kv, visible, sinks, scale)  # few queries: ATTN_FEW_BLOCK_H heads a program
            few, triton_kernels.ATTN_FEW_PROGRAMS = triton_kernels.ATTN_FEW_PROGRAMS, 0
            ops["sink_attention"](q, kv, visible, sinks, scale)  # ATTN_BLOCK_H heads a program
            triton_kernels.ATTN_FEW_PROGRAMS = few
            k = 512 if dtype == torch.float32 else 1024  # long enough for two K splits (and their fold)
            triton_kernels.matmul_nt(torch.randn(3, k, generator=gen).to(dtype),
                                     torch.randn(40, k, generator=gen).to(dtype))
        x, w = torch.randn(3, 1, 1024, generator=gen).bfloat16(), torch.randn(40, 1024, generator=gen).bfloat16()
        triton_kernels._grouped_matmul(x, w, 1, launch="wide")  # the prefill tile, its two K splits in one program
        triton_kernels._grouped_matmul(x, w, 1, launch="wide_short")  # the same in 64-row tiles
        triton_kernels._grouped_matmul(x, w, 1, launch="split", fused_fold=False)  # the fold kernel
        triton_kernels._grouped_matmul(x, w, 1, launch="split_wide")  # the batch-sized split-K tile
        triton_kernels._grouped_matmul(x, w, 1, launch="split_swap")  # weights on the left
        q, keys, weights = _indexer_sequence(gen, 2, 16)
        ops["indexer_scores"](q[None], keys[None], weights[None], 16**-0.5)
    finally:
        kernel_type.__getitem__ = original
    return launches


def _arg_type(arg) -> str:
    if isinstance(arg, torch.Tensor):
        return POINTER_TYPES[arg.dtype]
    if isinstance(arg, bool):
        return "i1"
    return "fp32" if isinstance(arg, float) else "i32"


LAUNCHES = _record_launches()


COMPILER = """
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deepinfer_batch_invariant import triton_kernels

results = []
for launch in json.load(sys.stdin):
    kernel = getattr(triton_kernels, launch["name"])
    types = iter(launch["types"])
    signature = {n: "constexpr" if i in kernel.constexprs else next(types) for i, n in enumerate(kernel.arg_names)}
    constants = {(kernel.arg_names.index(k),): v for k, v in launch["constants"].items()}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constants),
                              target=GPUTarget("cuda", launch["capability"], 32), options=launch["options"])
    ptx = compiled.asm["ptx"]
    results.append({"target": re.search(r"^\\.target (\\S+)", ptx, re.MULTILINE).group(1),
                    "cubin_bytes": len(compiled.asm["cubin"]),
                    "instructions": [i for i in ("wgmma", "tcgen05.mma", "mma.sync", "atom.global.gpu.acq_rel") if i in ptx],
                    "local_memory": "ld.local" in ptx or "st.local" in ptx,
                    "pdl": "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx})
json.dump(results, sys.stdout)
"""


def _compile_all(capability: int) -> list[tuple[str, tuple, dict]]:
    """Compile every recorded launch for one architecture in a fresh process without the interpreter (which
    patches ``triton.language`` in this one); returns (kernel, argument types, result) per launch."""
    launches, keys = [], []
    for (name, arg_types, _), (_, _, kwargs) in LAUNCHES.items():
        constants = {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
        if "EMULATE" in constants:
            constants["EMULATE"] = False  # the GPU path: tl.dot
        constants["PDL"] = True  # launched with programmatic dependent launch on a GPU (off under the interpreter)
        launches.append({"name": name, "types": list(arg_types), "constants": constants, "capability": capability,
                         "options": {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs}})
        keys.append((name, arg_types))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILER], input=json.dumps(launches), capture_output=True, check=False,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [(name, arg_types, result) for (name, arg_types), result in zip(keys, json.loads(done.stdout), strict=True)]


def test_every_kernel_of_the_cuda_variants_was_launched():
    """The plugin's kernels (the backend's own batch-invariant kernels are compile-checked by its tests)."""
    launched = {key[0] for key in LAUNCHES}
    defined = {name for name in dir(triton_kernels) if name.endswith("_kernel")}
    assert defined <= launched, sorted(defined - launched)


@pytest.mark.parametrize("capability", sorted(ARCHS))
def test_every_launch_compiles_for_the_architecture(capability):
    arch, tensor_core = ARCHS[capability]
    for name, arg_types, result in _compile_all(capability):
        assert result["target"] == arch and result["cubin_bytes"] > 0, name
        assert result["pdl"], f"{name}: no programmatic dependent launch on {arch}"
        if name == "_matmul_nt_kernel" and "*bf16" in arg_types:
            assert tensor_core in result["instructions"], f"bf16 GEMM tile on {arch}: {result['instructions']}"
            assert not result["local_memory"], f"bf16 GEMM tile on {arch}: registers in local memory"


def test_the_fused_fold_counts_with_an_acquire_release_atomic():
    """The split-K launch with the fused fold compiles its tile count to one acquire-release atomic at GPU scope (the
    partials the other programs stored are visible to the tile's last program)."""
    results = _compile_all(90)
    folds = [result for name, _, result in results if name == "_matmul_nt_kernel" and "atom.global.gpu.acq_rel" in
             result["instructions"]]
    assert folds, "no GEMM launch with the fused fold"
    assert ("FOLD", True) in {item for key in LAUNCHES if key[0] == "_matmul_nt_kernel" for item in key[2]}


def test_every_gemm_launch_was_recorded():
    """Each of ``LAUNCHES`` (tile and serial / split-K) is among the compiled launches."""
    recorded = {(dict(options)["BLOCK_M"], dict(options)["BLOCK_N"], dict(options)["SERIAL"], dict(options)["SWAP"])
                for name, _, options in LAUNCHES if name == "_matmul_nt_kernel"}
    for launch, spec in triton_kernels.LAUNCHES.items():
        block_m, block_n = spec.configs[torch.bfloat16][:2]
        assert (block_m, block_n, spec.serial, spec.swap) in recorded, launch

"""Op ``greedy_sample`` as two Triton kernels: each row's argmax, its raw log-probability and its rank.

The reference (``sampling.sampler.greedy_rows``) is ~16 torch kernels after every decode step: ``log_softmax``,
``max``, the lowest-id ``min``, the rank's ``sum``, each a one-block reduction over the whole vocabulary at batch 1,
all on the path to the next step, which reads the sampled token. Here ``_partials_kernel`` splits each row into chunks
(``BLOCK`` logits a program): per chunk its maximum, the lowest id holding it, how many hold it and the sum of
``exp(x - max)``. ``_finish_kernel`` merges a row's chunks: the argmax (lowest id among equals), the log-probability
``-log(sum of exp(x - max))`` (the argmax's ``x - max`` is 0, as in ``log_softmax``) and the rank, the count of
logits equal to the maximum. Only the sum's order differs from the reference (float rounding); the reference's rank
also counts a logit within half an ulp of ``log_softmax``'s shift below the maximum, which an exact count does not.
On by default; ``DEEPINFER_NVIDIA_GREEDY=0`` keeps the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100 import envs
from deepinfer_nvidia_sm100.kernels import pdl

BLOCK = 4096  # logits a program: the preset's vocabulary in 32 programs a row


def enabled() -> bool:
    """Whether ``DEEPINFER_NVIDIA_GREEDY`` puts the op in the op table (on by default; ``0``: the reference)."""
    return envs.DEEPINFER_NVIDIA_GREEDY


@triton.jit
def _partials_kernel(logits_ptr, stride_row, V, maxima_ptr, sums_ptr, ids_ptr, counts_ptr, CHUNKS,
                     BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, chunk): the chunk's maximum, ``sum(exp(x - max))``, lowest id of the maximum and its count,
    stored at ``[row, chunk]`` (the sum is 0 where every logit is ``-inf``)."""
    pdl.begin(PDL)
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    best = tl.max(x, axis=0)
    at_best = x == best  # [BLOCK]
    total = tl.where(best == float("-inf"), 0.0, tl.sum(tl.exp(x - best), axis=0))
    out = row * CHUNKS + chunk
    tl.store(maxima_ptr + out, best)
    tl.store(sums_ptr + out, total)
    tl.store(ids_ptr + out, tl.min(tl.where(at_best, cols, V), axis=0))
    tl.store(counts_ptr + out, tl.sum(at_best.to(tl.int32), axis=0))


@triton.jit
def _finish_kernel(maxima_ptr, sums_ptr, ids_ptr, counts_ptr, token_ptr, logprob_ptr, rank_ptr, V, CHUNKS,
                   CHUNKS_P2: tl.constexpr, PDL: tl.constexpr = False):
    """Program ``row``: its chunks merged into the argmax, its log-probability and its rank."""
    pdl.begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_P2)  # [CHUNKS_P2]
    real = c < CHUNKS
    maxima = tl.load(maxima_ptr + row * CHUNKS + c, mask=real, other=float("-inf"))
    best = tl.max(maxima, axis=0)
    at_best = real & (maxima == best)
    scaled = tl.load(sums_ptr + row * CHUNKS + c, mask=real, other=0.0) * tl.exp(maxima - best)
    total = tl.sum(tl.where(real & (maxima > float("-inf")), scaled, 0.0), axis=0)
    token = tl.min(tl.where(at_best, tl.load(ids_ptr + row * CHUNKS + c, mask=real, other=V), V), axis=0)
    rank = tl.sum(tl.where(at_best, tl.load(counts_ptr + row * CHUNKS + c, mask=real, other=0), 0), axis=0)
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, -tl.log(total))
    tl.store(rank_ptr + row, rank.to(tl.int64))


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``reference.greedy_sample`` (fp32 ``logits [R, V]``, unit last stride or not) in two launches: token ids,
    raw log-probabilities and ranks, ``[R]`` each (int64, float32, int64)."""
    rows, vocab = logits.shape
    logits = logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    chunks = triton.cdiv(vocab, BLOCK)
    device = logits.device
    token_ids = torch.empty(rows, dtype=torch.long, device=device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    ranks = torch.empty(rows, dtype=torch.long, device=device)
    if rows == 0 or vocab == 0:
        return token_ids, logprobs, ranks
    floats = torch.empty(2, rows, chunks, dtype=torch.float32, device=device)  # maxima, sums
    ints = torch.empty(2, rows, chunks, dtype=torch.int32, device=device)  # lowest ids of the maxima, their counts
    _partials_kernel[(rows, chunks)](logits, logits.stride(0), vocab, floats[0], floats[1], ints[0], ints[1], chunks,
                                     BLOCK=BLOCK, num_warps=8, **pdl.launch())
    _finish_kernel[(rows,)](floats[0], floats[1], ints[0], ints[1], token_ids, logprobs, ranks, vocab, chunks,
                            CHUNKS_P2=triton.next_power_of_2(chunks), num_warps=1, **pdl.launch())
    return token_ids, logprobs, ranks

"""Top-k sparse CSA attention: each query row attends to its own window keys and its selected entries only.

The dense path (``Attention`` with ``layout.attention_visible``) hands the attention op every key of the sequence,
``[S, Lk + E, d]``, and a mask ``[S, Lq, Lk + E]``: a kernel that walks a row's visible key blocks still reads nearly
every block once the indexer's ``k`` selected entries are spread over ``E / 64`` blocks, so its work grows with the
context although each row reads ``window + k`` keys. ``DEEPINFER_SPARSE_CSA_ATTENTION`` picks how a CSA layer whose
indexer selects reads them instead (``sparse_mode``):

- ``1`` (``index``): as DeepSeek's FlashMLA sparse kernels do, each row lists the keys it reads, ``index [S, Lq, W +
  k]`` (its window keys, ``ops.visible_index`` of the window's mask, then its selected entries offset by ``Lk`` as the
  indexer's top-k writes them, ``ops.indexer_topk_index_counts`` of each row's visible-entry count, -1 for none), and
  ``ops.roped_sparse_sink_attention`` reads them in place: the window keys from the step's ``[S, Lk, d]``, the entries
  from the layer's paged compressed-entry store (the step gathers no ``[S, E, d]`` copy of them), with no entry
  visibility mask, no selection mask and no ``[S, Lq, Lk + E]`` mask.
- ``gather``: each query row becomes a one-query row of its own with the keys it reads gathered (``[S * Lq, W + k,
  d]``) through the table's ``roped_sink_attention`` over decode-shaped rows, in slices of at most ``GATHER_BYTES``.

The same keys are visible as in the dense path, so both equal it up to the order of floating-point sums.
"""

from __future__ import annotations

import torch

from deepinfer_core import envs
from deepinfer_core.errors import EnvironmentVariableError
from deepinfer_core.ops.table import OpTable
from deepinfer_core.options import parse_flag

GATHER_BYTES = 1 << 30  # gathered keys per slice of query rows
MODES = ("dense", "index", "gather")


def sparse_mode(environ=None) -> str:
    """``DEEPINFER_SPARSE_CSA_ATTENTION`` as one of ``MODES``: ``0`` (or another false word) ``dense``, ``1`` (or
    another true word) ``index``, ``gather`` ``gather``."""
    raw = envs.get("DEEPINFER_SPARSE_CSA_ATTENTION", environ).strip().lower()
    if raw == "gather":
        return "gather"
    flag = parse_flag(raw)
    if flag is None:
        raise EnvironmentVariableError(f"DEEPINFER_SPARSE_CSA_ATTENTION must be 0 (dense), 1 (sparse, read by index) "
                                       f"or gather (sparse, keys gathered per row), got {raw!r}")
    return "index" if flag else "dense"


def indexed_roped_attention(ops: OpTable, q: torch.Tensor, keys: torch.Tensor, window_visible: torch.Tensor,
                            entry_index: torch.Tensor, window: int, sinks: torch.Tensor, scale: float, eps: float,
                            cos: torch.Tensor, sin: torch.Tensor, entries: tuple = ()) -> torch.Tensor:
    """``ops.roped_sparse_sink_attention`` of ``q [S, Lq, H, d]`` over the keys visible through ``window_visible [S,
    Lq, Lk]`` (at most ``window`` per row) and the entries ``entry_index [S, Lq, k]`` (the indexer's selection,
    ``ops.indexer_topk_index_counts``: -1 for none), each row reading its listed keys in place: ``keys [S, Lk + E, d]``, or
    ``keys [S, Lk, d]`` (the window's) and ``entries`` = (paged store, entry blocks ``[S, E]``, entry rows ``[S,
    E]``), the compressed entries where they lie. ``cos`` / ``sin``: ``[S, Lq, rope_dim // 2]``. Returns ``[S, Lq, H,
    d]``."""
    return ops.roped_sparse_sink_attention(q, keys, key_index(ops, window_visible, entry_index, window), sinks, scale,
                                           eps, cos, sin, *entries)


def key_index(ops: OpTable, window_visible: torch.Tensor, entry_index: torch.Tensor, window: int) -> torch.Tensor:
    """``[S, Lq, W + k]`` int32: each row's window keys (``W = min(window, Lk)``, ``ops.visible_index`` of
    ``window_visible [S, Lq, Lk]``), then its entries ``entry_index [S, Lq, k]`` offset by ``Lk``, as indices into the
    keys ``[S, Lk + E, d]``, -1 for none."""
    Lk = window_visible.shape[-1]
    window_index = ops.visible_index(window_visible, min(window, Lk))  # [S, Lq, W]
    return torch.cat([window_index, torch.where(entry_index >= 0, entry_index + Lk, -1).to(torch.int32)], dim=-1)


def row_key_indices(visible: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``count`` visible key indices per row of ``visible [S, Lq, N]``, ascending: ``(indices, valid)``, each
    ``[S, Lq, min(count, N)]`` (invalid places hold ``N - 1``; every visible key is listed where a row has at most
    ``count``)."""
    n = visible.shape[-1]
    picked = torch.topk(visible.view(torch.uint8), min(count, n), dim=-1, sorted=False).indices  # visible first
    ordered = torch.where(visible.gather(-1, picked), picked, n).sort(dim=-1).values  # [S, Lq, count]
    valid = ordered < n
    return ordered.clamp(max=n - 1), valid


def rows_per_slice(num_seqs: int, query_len: int, keys_per_row: int, row_bytes: int, budget: int) -> int:
    """Query rows per slice so that ``num_seqs * rows`` rows of ``keys_per_row`` gathered keys (``row_bytes`` each)
    stay within ``budget`` bytes: at least one, at most ``query_len``."""
    return max(1, min(query_len, budget // max(1, num_seqs * keys_per_row * row_bytes)))


def sparse_roped_attention(ops: OpTable, q: torch.Tensor, keys: torch.Tensor, window_visible: torch.Tensor,
                           selected: torch.Tensor, window: int, topk: int, sinks: torch.Tensor, scale: float,
                           eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``ops.roped_sink_attention`` of ``q [S, Lq, H, d]`` over the keys ``[S, Lk + E, d]`` visible through
    ``window_visible [S, Lq, Lk]`` (at most ``window`` per row) and ``selected [S, Lq, E]`` (at most ``topk``), each
    row over its gathered keys only. ``cos`` / ``sin``: ``[S, Lq, rope_dim // 2]``. Returns ``[S, Lq, H, d]``."""
    S, Lq, H, d = q.shape
    Lk = window_visible.shape[-1]
    win_index, win_valid = row_key_indices(window_visible, window)  # [S, Lq, W'] each
    width = win_index.shape[-1] + min(topk, selected.shape[-1])
    rows = rows_per_slice(S, Lq, width, d * keys.element_size(), GATHER_BYTES)
    seq = torch.arange(S, device=keys.device)[:, None, None]  # [S, 1, 1]
    out = q.new_empty(q.shape)  # [S, Lq, H, d]
    for start in range(0, Lq, rows):
        part = slice(start, start + rows)
        entry_index, entry_valid = row_key_indices(selected[:, part], topk)  # [S, r, k'] each
        index = torch.cat([win_index[:, part], entry_index + Lk], dim=-1)  # [S, r, W' + k']
        valid = torch.cat([win_valid[:, part], entry_valid], dim=-1)
        n = index.shape[0] * index.shape[1]
        row_keys = keys[seq, index].view(n, width, d)  # [S * r, W' + k', d]
        attended = ops.roped_sink_attention(q[:, part].reshape(n, 1, H, d), row_keys, valid.view(n, 1, width), sinks,
                                            scale, eps, cos[:, part].reshape(n, 1, -1),
                                            sin[:, part].reshape(n, 1, -1))  # [S * r, 1, H, d]
        out[:, part] = attended.view(S, -1, H, d)
    return out

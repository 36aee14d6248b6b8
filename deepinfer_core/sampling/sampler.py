"""The sampler: one pure function from a step's logits and per-row metadata to sampled tokens.

Order of operations (as vLLM):

1. log-probabilities to return: ``log_softmax`` of the *raw* logits (vLLM's default
   ``logprobs_mode="raw_logprobs"``), before any penalty, mask, temperature or filter.
2. per-request controls (vLLM's order): tokens outside ``allowed_token_ids`` and the ``bad_words`` a row would
   complete are set to ``-inf``, then ``logit_bias`` is added.
3. penalties: repetition (tokens in the prompt or the output), then frequency and presence (tokens in the
   output).
4. masks: stop / EOS ids of rows that have fewer than ``min_tokens`` output tokens, and the
   optional allowed-token mask (grammars), set to ``-inf``.
5. logits processors (``logits_processor.py``), each on the rows it applies to.
6. greedy rows (temperature 0) take the argmax of these logits.
7. random rows: divide by temperature, then top-k, top-p, min-p filtering, then Gumbel-max with
   counter-based noise (``noise.py``): ``argmax(logits / T + gumbel(seed, position, vocab id))``.

Every step but the processors is a per-row mask, add or scale, so a row's result never depends on the other rows
(batch invariance); a processor keeps that as long as it treats each row on its own.

Ties in any argmax (greedy, or the measure-zero Gumbel ties) go to the lowest token id. Top-k
keeps exactly k tokens: ranking is a stable descending sort, so among equal logits the lower id wins.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Mapping, Sequence

import torch

from deepinfer_core.device_copy import to_device
from deepinfer_core.sampling.bad_words import banned_next_ids
from deepinfer_core.sampling.logits_processor import LogitsRow, ProcessorRows, applies_to, apply_logits_processors
from deepinfer_core.sampling.noise import derive_seed, gumbel_noise, to_int64_seed
from deepinfer_core.sampling.params import SamplingParams

NEG_INF = float("-inf")


@dataclasses.dataclass
class SamplingMetadata:
    """Per-row sampling inputs for one step; row i describes row i of the logits.

    Tensors are 1-D ``[num_rows]`` on the logits' device unless noted (``from_params`` leaves them on the host
    where every row is greedy without penalties: the sampler then reads none of them on the device). Build it with
    ``SamplingMetadata.from_params`` or by hand.

    Attributes:
        temperature: float32; 0 means greedy.
        top_p: float32 in (0, 1]; 1 is off.
        top_k: int64; 0 is off.
        min_p: float32 in [0, 1]; 0 is off.
        repetition_penalty / presence_penalty / frequency_penalty: float32; 1 / 0 / 0 are off.
        seeds: int64 per-row seeds (see ``noise.derive_seed`` for completion i of n).
        positions: int64 index of the token being generated within its sequence (prompt included).
        prompt_token_ids: per row, the prompt ids (repetition penalty counts them, as vLLM).
        output_token_ids: per row, the ids generated so far (all penalties; min_tokens count).
        min_tokens: per row, stop ids are masked while ``num_output_tokens[i] < min_tokens[i]``.
        stop_token_ids: per row, the ids masked by ``min_tokens`` (stop ids plus EOS unless ignored).
        allowed_token_mask: optional bool ``[num_rows, vocab]``; False entries can never be sampled.
        num_logprobs: how many top log-probabilities to return per row (the max over rows), or None.
        num_output_tokens: per row, tokens generated before this one, including any whose id is still on the
            device (asynchronous scheduling); None means ``len(output_token_ids[i])``.
        kinds: which features the rows use, known on the host (``from_params`` sets it); None makes the
            sampler find out from the tensors, which waits for the device.
        logit_bias: per row, token id -> bias, or None for the row; None for every row.
        allowed_token_ids: per row, the only ids it may sample, or None for the row; None for every row.
        bad_words_token_ids: per row, the token sequences of its bad words (``bad_words.tokenize_bad_words``).
        logits_processors: the processors to run, each with the rows it applies to.
        logits_rows: one ``LogitsRow`` per row, for the processors (empty when there are none).
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    prompt_token_ids: Sequence[Sequence[int]]
    output_token_ids: Sequence[Sequence[int]]
    min_tokens: Sequence[int]
    stop_token_ids: Sequence[Sequence[int]]
    allowed_token_mask: torch.Tensor | None = None
    num_logprobs: int | None = None
    num_output_tokens: Sequence[int] | None = None
    kinds: RowKinds | None = None
    logit_bias: Sequence[Mapping[int, float] | None] | None = None
    allowed_token_ids: Sequence[Sequence[int] | None] | None = None
    bad_words_token_ids: Sequence[Sequence[Sequence[int]]] | None = None
    logits_processors: Sequence[ProcessorRows] = ()
    logits_rows: Sequence[LogitsRow] = ()

    @property
    def num_rows(self) -> int:
        """Number of rows (requests sampled this step)."""
        return int(self.temperature.shape[0])

    def blocked_stop_ids(self) -> tuple[list[int], list[int]]:
        """(rows, ids) of the stop ids masked this step: those of rows with fewer than ``min_tokens`` outputs."""
        rows: list[int] = []
        cols: list[int] = []
        counts = self.num_output_tokens
        if counts is None:
            counts = [len(out) for out in self.output_token_ids]
        for i, (min_tokens, count, stops) in enumerate(zip(self.min_tokens, counts, self.stop_token_ids)):
            if count < min_tokens:
                rows.extend([i] * len(stops))
                cols.extend(stops)
        return rows, cols

    def plain_greedy(self) -> bool:
        """Whether every row takes the argmax of its raw logits: greedy, no penalty, no mask, no control, no logits
        processor, no top-n log-probabilities (then ``greedy_rows`` is the whole sampler)."""
        kinds = self.row_kinds()
        return (kinds.all_greedy and not kinds.penalties and not kinds.controls and self.allowed_token_mask is None
                and not self.logits_processors and self.num_logprobs is None and not self.blocked_stop_ids()[0])

    def row_kinds(self) -> RowKinds:
        """``kinds``, or (hand-built metadata) the same flags read from the tensors."""
        if self.kinds is not None:
            return self.kinds
        greedy = self.temperature == 0
        return RowKinds(
            all_greedy=bool(greedy.all()), any_greedy=bool(greedy.any()),
            penalties=bool(((self.repetition_penalty != 1) | (self.presence_penalty != 0)
                            | (self.frequency_penalty != 0)).any()),
            top_k_top_p=bool(((self.top_k > 0) | (self.top_p < 1)).any()), min_p=bool((self.min_p > 0).any()),
            controls=any(any(rows or ()) for rows in (self.logit_bias, self.allowed_token_ids,
                                                      self.bad_words_token_ids)))

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        *,
        seeds: Sequence[int],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        eos_token_id: int | None = None,
        positions: Sequence[int] | None = None,
        num_output_tokens: Sequence[int] | None = None,
        allowed_token_mask: torch.Tensor | None = None,
        bad_words_token_ids: Sequence[Sequence[Sequence[int]]] | None = None,
        logits_processors: Sequence[Callable] = (),
        request_ids: Sequence[str] | None = None,
        device: torch.device | str = "cpu",
        prepared: Mapping[int, object] | None = None,
    ) -> SamplingMetadata:
        """Build metadata for rows described by ``SamplingParams``.

        Args:
            params: one ``SamplingParams`` per row.
            seeds: one resolved int seed per row (see ``request_seed``).
            prompt_token_ids / output_token_ids: per row, prompt ids and ids generated so far.
            eos_token_id: the model's EOS id, masked under ``min_tokens`` unless ``ignore_eos``.
            positions: per row, the index of the token being generated; defaults to
                ``len(prompt) + len(output)``.
            num_output_tokens: per row, tokens generated before this one when some are still on the device
                (``SamplingMetadata.num_output_tokens``); None: ``len(output)``.
            allowed_token_mask: optional bool ``[num_rows, vocab]``.
            bad_words_token_ids: per row, its bad words tokenized (``bad_words.tokenize_bad_words``); needed when a
                row has ``bad_words``.
            logits_processors: processors to run on the rows they apply to (``logits_processor.py``).
            request_ids: per row, the request id the processors see (default: the row index).
            device: where to put the per-row tensors (the logits' device); they stay on the host where every row is
                greedy without penalties (no upload: the sampler reads none of them on the device then).
            prepared: index into ``logits_processors`` -> the ``prepare`` of that two-phase processor, started for
                the rows it applies to (``ProcessorRows.prepared``); the others prepare in the sampler.
        """
        rows = len(params)
        for name, values in (("seeds", seeds), ("prompt_token_ids", prompt_token_ids),
                             ("output_token_ids", output_token_ids)):
            if len(values) != rows:
                raise ValueError(f"{name} has {len(values)} rows but params has {rows}")
        if positions is None:
            positions = [len(p) + len(o) for p, o in zip(prompt_token_ids, output_token_ids)]

        floats = torch.tensor([[float(getattr(p, name)) for p in params] for name in _FLOAT_FIELDS],
                              dtype=torch.float32).reshape(len(_FLOAT_FIELDS), rows)  # [fields, num_rows]
        ints = torch.tensor([[p.top_k for p in params], [to_int64_seed(s) for s in seeds], list(positions)],
                            dtype=torch.int64).reshape(3, rows)  # [3, num_rows]: top_k, seeds, positions
        kinds = RowKinds.of(params)
        if not kinds.all_greedy or kinds.penalties:
            floats, ints = to_device(floats, device), to_device(ints, device)
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        if bad_words_token_ids is None and any(p.bad_words for p in params):
            raise ValueError("rows have bad_words but no bad_words_token_ids were given; tokenize them first "
                             "(deepinfer_core.sampling.bad_words.tokenize_bad_words)")
        prepared = prepared or {}
        plan = [ProcessorRows(proc, rows, prepared.get(k)) for k, proc in enumerate(logits_processors)
                if (rows := tuple(i for i, p in enumerate(params) if applies_to(proc, p)))]
        logits_rows = []
        if plan:
            counts = num_output_tokens or [len(o) for o in output_token_ids]
            ids = request_ids or [str(i) for i in range(rows)]
            logits_rows = [LogitsRow(*row) for row in zip(ids, params, prompt_token_ids, output_token_ids, counts)]
        return cls(
            **dict(zip(_FLOAT_FIELDS, floats, strict=True)),
            top_k=ints[0],
            seeds=ints[1],
            positions=ints[2],
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids,
            min_tokens=[p.min_tokens for p in params],
            stop_token_ids=[sorted(p.all_stop_token_ids(eos_token_id)) for p in params],
            allowed_token_mask=allowed_token_mask,
            num_logprobs=max(logprobs) if logprobs else None,
            num_output_tokens=num_output_tokens,
            kinds=kinds,
            logit_bias=[p.logit_bias for p in params] if kinds.controls else None,
            allowed_token_ids=[p.allowed_token_ids for p in params] if kinds.controls else None,
            bad_words_token_ids=bad_words_token_ids if kinds.controls else None,
            logits_processors=plan,
            logits_rows=logits_rows,
        )


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclasses.dataclass(frozen=True)
class RowKinds:
    """Which sampling features any row of a step uses, known on the host: the sampler skips what no row needs
    without reading a device tensor (each such read would wait for the step's forward pass)."""

    all_greedy: bool
    any_greedy: bool
    penalties: bool
    top_k_top_p: bool
    min_p: bool
    controls: bool = False  # logit_bias, allowed_token_ids or bad_words

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> RowKinds:
        greedy = [p.temperature == 0 for p in params]
        return cls(
            all_greedy=all(greedy), any_greedy=any(greedy),
            penalties=any(p.uses_penalties for p in params),
            top_k_top_p=any(p.top_k > 0 or p.top_p < 1 for p in params), min_p=any(p.min_p > 0 for p in params),
            controls=any(p.uses_logits_controls for p in params))


@dataclasses.dataclass
class SamplerOutput:
    """What ``sample`` returns; all tensors on the logits' device.

    Attributes:
        sampled_token_ids: int64 ``[num_rows]``.
        sampled_logprobs: float32 ``[num_rows]``, raw-model log-probability of the sampled token.
        sampled_ranks: int64 ``[num_rows]``, 1 = most likely under the raw model distribution.
        top_token_ids: int64 ``[num_rows, n]`` most likely ids (descending), or None if not requested.
        top_logprobs: float32 ``[num_rows, n]`` their log-probabilities, or None.
    """

    sampled_token_ids: torch.Tensor
    sampled_logprobs: torch.Tensor
    sampled_ranks: torch.Tensor
    top_token_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


@dataclasses.dataclass
class PromptLogprobsOutput:
    """What ``compute_prompt_logprobs`` returns.

    Attributes:
        token_logprobs: float32 ``[num_tokens]``, log-probability of each target id.
        ranks: int64 ``[num_tokens]``, rank of each target id (1 = most likely).
        top_token_ids: int64 ``[num_tokens, n]``; top_logprobs: float32 ``[num_tokens, n]``.
    """

    token_logprobs: torch.Tensor
    ranks: torch.Tensor
    top_token_ids: torch.Tensor
    top_logprobs: torch.Tensor


def request_seed(params: SamplingParams, seq_index: int = 0) -> int:
    """The seed for completion ``seq_index`` of a request: derived from ``params.seed``, or random.

    Call once per completion when the request arrives and keep it: the draws of a completion are
    then a function of (seed, position) only. Unseeded requests get a fresh random 63-bit seed.
    """
    base = params.seed if params.seed is not None else secrets.randbits(63)
    return derive_seed(base, seq_index)


# ---------------------------------------------------------------------------------------------
# the sampler


def sample(logits: torch.Tensor, metadata: SamplingMetadata,
           greedy: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None = None) -> SamplerOutput:
    """Sample one token per row of ``logits`` ``[num_rows, vocab]`` (float32) as ``metadata`` says.

    Pure: ``logits`` is not modified, no global RNG is used; the result of a row depends only on
    that row's logits and metadata. See the module docstring for the order of operations.

    ``greedy``: computes ``greedy_rows`` (a backend's ``greedy_sample`` op); it takes a step whose every row is
    greedy with nothing to apply first (no penalty, no mask, no top-n log-probabilities).
    """
    _check_shapes(logits, metadata)
    logits = logits.float()  # [num_rows, vocab]
    if metadata.plain_greedy():
        return SamplerOutput(*(greedy or greedy_rows)(logits))
    raw_logprobs = torch.log_softmax(logits, dim=-1)  # [num_rows, vocab]
    processed = processed_logits(logits, metadata)  # [num_rows, vocab]
    greedy = metadata.temperature == 0  # [num_rows]
    token_ids = _sample_ids(processed, greedy, metadata)  # [num_rows]
    return _logprob_output(raw_logprobs, token_ids, metadata.num_logprobs)


def processed_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Steps 2-5 of the module docstring (controls, penalties, masks, logits processors) on float32 ``logits``
    ``[num_rows, vocab]``: what greedy rows take the argmax of; a new tensor."""
    processed = apply_logits_controls(logits, metadata)  # [num_rows, vocab]
    processed = apply_penalties(processed, metadata)  # [num_rows, vocab]
    processed = _apply_masks(processed, metadata)  # [num_rows, vocab]
    return apply_logits_processors(processed, metadata.logits_processors, metadata.logits_rows)


def sampling_probs(processed: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution random rows sample from (step 7 before the noise): ``softmax`` of the processed logits
    divided by temperature and filtered by top-k / top-p / min-p; float32 ``[num_rows, vocab]``. (Greedy rows:
    temperature 1; the caller treats them as one-hot on their argmax.)"""
    return torch.softmax(_filtered_scaled_logits(processed, metadata), dim=-1)


def logprob_output(logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int | None) -> SamplerOutput:
    """A ``SamplerOutput`` for given ``token_ids`` ``[num_rows]``: their raw log-probabilities and ranks under
    ``logits`` ``[num_rows, vocab]``, and the top ``num_logprobs``."""
    return _logprob_output(torch.log_softmax(logits.float(), dim=-1), token_ids, num_logprobs)


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, top_n: int) -> PromptLogprobsOutput:
    """Log-probabilities of prompt tokens under the raw model output.

    Args:
        logits: ``[num_tokens, vocab]``; row i is the model output that predicts ``target_ids[i]``
            (i.e. the logits at prompt position i and the prompt id at position i + 1).
        target_ids: int ``[num_tokens]``.
        top_n: how many top log-probabilities to return per token (>= 0).
    """
    if logits.dim() != 2 or target_ids.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be [num_tokens, vocab] and target_ids [num_tokens], got {tuple(logits.shape)} "
            f"and {tuple(target_ids.shape)}"
        )
    if top_n < 0:
        raise ValueError(f"top_n must be >= 0, got {top_n}")
    raw_logprobs = torch.log_softmax(logits.float(), dim=-1)  # [num_tokens, vocab]
    out = _logprob_output(raw_logprobs, target_ids.to(torch.int64), top_n)
    return PromptLogprobsOutput(out.sampled_logprobs, out.sampled_ranks, out.top_token_ids, out.top_logprobs)


def _check_shapes(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_rows, vocab], got shape {tuple(logits.shape)}")
    if logits.shape[0] != metadata.num_rows:
        raise ValueError(f"logits has {logits.shape[0]} rows but metadata has {metadata.num_rows}")
    mask = metadata.allowed_token_mask
    if mask is not None and (mask.shape != logits.shape or mask.dtype != torch.bool):
        raise ValueError(
            f"allowed_token_mask must be bool {tuple(logits.shape)}, got {mask.dtype} {tuple(mask.shape)}"
        )


# ---------------------------------------------------------------------------------------------
# penalties and masks


def token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Occurrence counts ``[num_rows, vocab]`` (int64) of each row's token ids."""
    rows = len(token_ids)
    width = max((len(ids) for ids in token_ids), default=0)
    padded = torch.full((rows, width), vocab_size, dtype=torch.int64)  # [num_rows, width]; pad = vocab_size
    for i, ids in enumerate(token_ids):  # the only row loop: ragged lists -> padded tensor
        padded[i, : len(ids)] = torch.as_tensor(list(ids), dtype=torch.int64)
    padded = padded.to(device)
    counts = torch.zeros((rows, vocab_size + 1), dtype=torch.int64, device=device)  # [num_rows, vocab + 1]
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab_size]  # [num_rows, vocab]; the pad column dropped


def apply_logits_controls(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """``allowed_token_ids`` and ``bad_words`` (to ``-inf``), then ``logit_bias`` (added); returns a new tensor.

    The index lists are built on the host from the rows' parameters and output ids; each row's changes touch only
    that row.
    """
    if not metadata.row_kinds().controls:
        return logits
    rows = metadata.num_rows
    allowed = metadata.allowed_token_ids or [None] * rows
    bias = metadata.logit_bias or [None] * rows
    words = metadata.bad_words_token_ids or [()] * rows
    restricted = [i for i, ids in enumerate(allowed) if ids is not None]
    allowed_at = [(i, t) for i in restricted for t in allowed[i]]
    banned_at = [(i, t) for i, word_ids in enumerate(words) if word_ids
                 for t in banned_next_ids(word_ids, metadata.output_token_ids[i])]
    bias_at = [(i, t) for i, b in enumerate(bias) if b for t in b]
    logits = logits.clone()  # [num_rows, vocab]
    if restricted:
        keep = torch.zeros_like(logits, dtype=torch.bool)  # [num_rows, vocab]
        keep[_device_index(restricted, logits.device)] = True  # restricted rows: nothing kept yet
        keep = ~keep
        keep[_device_pairs(allowed_at, logits.device)] = True
        logits.masked_fill_(~keep, NEG_INF)
    if banned_at:
        logits[_device_pairs(banned_at, logits.device)] = NEG_INF
    if bias_at:
        values = to_device(torch.tensor([bias[i][t] for i, t in bias_at], dtype=logits.dtype), logits.device)
        logits.index_put_(_device_pairs(bias_at, logits.device), values, accumulate=True)
    return logits


def _device_index(values: list[int], device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=torch.long), device)  # [k]


def _device_pairs(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    index = to_device(torch.tensor(pairs, dtype=torch.long).T.contiguous(), device)  # [2, k]
    return index[0], index[1]


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition, frequency and presence penalties (vLLM's formulas); returns a new tensor.

    For a token seen in the prompt or the output, repetition penalty r gives ``l / r`` if ``l > 0``
    else ``l * r``. Then ``l -= frequency * count_in_output + presence * (count_in_output > 0)``.
    """
    if not metadata.row_kinds().penalties:
        return logits
    rep = metadata.repetition_penalty  # [num_rows]
    pres = metadata.presence_penalty  # [num_rows]
    freq = metadata.frequency_penalty  # [num_rows]
    vocab = logits.shape[1]
    out_counts = token_counts(metadata.output_token_ids, vocab, logits.device)  # [num_rows, vocab]
    seen_out = out_counts > 0  # [num_rows, vocab]
    seen = seen_out | (token_counts(metadata.prompt_token_ids, vocab, logits.device) > 0)  # [num_rows, vocab]
    rep_per_token = torch.where(seen, rep[:, None], torch.ones_like(logits))  # [num_rows, vocab]
    logits = torch.where(logits > 0, logits / rep_per_token, logits * rep_per_token)  # [num_rows, vocab]
    logits = logits - freq[:, None] * out_counts.to(logits.dtype)  # [num_rows, vocab]
    return logits - pres[:, None] * seen_out.to(logits.dtype)  # [num_rows, vocab]


def _apply_masks(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Set min_tokens-blocked stop ids and disallowed tokens to -inf; returns a new tensor."""
    rows, cols = metadata.blocked_stop_ids()
    mask = metadata.allowed_token_mask
    if not rows and mask is None:
        return logits
    logits = logits.clone()  # [num_rows, vocab]
    if rows:
        index = to_device(torch.tensor([rows, cols], dtype=torch.long), logits.device)  # [2, num_masked]
        logits.index_put_((index[0], index[1]), logits.new_full((), NEG_INF))
    if mask is not None:
        if not bool(mask.any(dim=-1).all()):
            bad = (~mask.any(dim=-1)).nonzero().flatten().tolist()
            raise ValueError(f"allowed_token_mask allows no token at all in rows {bad}")
        logits.masked_fill_(~mask, NEG_INF)
    return logits


# ---------------------------------------------------------------------------------------------
# filtering and drawing


def argmax_lowest(scores: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax ``[num_rows]`` with ties resolved to the lowest index."""
    vocab = scores.shape[-1]
    best = scores.max(dim=-1, keepdim=True).values  # [num_rows, 1]
    ids = torch.arange(vocab, device=scores.device).expand_as(scores)  # [num_rows, vocab]
    return torch.where(scores == best, ids, vocab).min(dim=-1).values  # [num_rows]


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``top_k`` best tokens (0 = all), then its smallest nucleus of mass >= ``top_p``.

    Ranking is a stable descending sort (equal logits: lower id first), so exactly k tokens stay.
    A token stays in the nucleus if the probability mass strictly before it is < top_p; the best
    token always stays; rows with top_p >= 1 skip the nucleus step (so rounding never drops a token). Returns a new tensor.
    """
    vocab = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)  # [num_rows, vocab] x2
    k = torch.where(top_k > 0, top_k, vocab)  # [num_rows]
    keep = torch.arange(vocab, device=logits.device)[None, :] < k[:, None]  # [num_rows, vocab], sorted order
    probs = sorted_logits.masked_fill(~keep, NEG_INF).softmax(dim=-1)  # [num_rows, vocab]
    mass_before = torch.nn.functional.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))  # [num_rows, vocab], exclusive
    # mass_before is 0 for the best token and top_p > 0, so the best token always stays.
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1)  # [num_rows, vocab]
    keep_vocab_order = torch.empty_like(keep).scatter_(1, sorted_ids, keep)  # [num_rows, vocab]
    return logits.masked_fill(~keep_vocab_order, NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with ``prob < min_p * max_prob`` (done in log space); returns a new tensor."""
    best = logits.max(dim=-1, keepdim=True).values  # [num_rows, 1]
    threshold = best + torch.log(min_p)[:, None]  # [num_rows, 1]; log(0) = -inf keeps everything
    return logits.masked_fill(logits < threshold, NEG_INF)


def _filtered_scaled_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Temperature, then top-k / top-p, then min-p (each only if some row uses it)."""
    temperature = torch.where(metadata.temperature == 0, 1.0, metadata.temperature)  # [num_rows]
    scaled = logits / temperature[:, None]  # [num_rows, vocab]
    kinds = metadata.row_kinds()
    if kinds.top_k_top_p:
        scaled = apply_top_k_top_p(scaled, metadata.top_k, metadata.top_p)
    if kinds.min_p:
        scaled = apply_min_p(scaled, metadata.min_p)
    return scaled  # [num_rows, vocab]


def _sample_ids(processed: torch.Tensor, greedy: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Greedy argmax for greedy rows, seeded Gumbel-max for the others; int64 ``[num_rows]``."""
    kinds = metadata.row_kinds()
    greedy_ids = argmax_lowest(processed) if kinds.any_greedy else None  # [num_rows]
    if kinds.all_greedy:
        return greedy_ids
    scaled = _filtered_scaled_logits(processed, metadata)  # [num_rows, vocab]
    gumbel = gumbel_noise(metadata.seeds, metadata.positions, processed.shape[1])  # [num_rows, vocab], float64
    random_ids = argmax_lowest(scaled.to(torch.float64) + gumbel)  # [num_rows]
    if greedy_ids is None:
        return random_ids
    return torch.where(greedy, greedy_ids, random_ids)  # [num_rows]


# ---------------------------------------------------------------------------------------------
# log-probabilities


def greedy_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampler's result where every row is plain greedy (``SamplingMetadata.plain_greedy``): each row's argmax
    (ties to the lowest id), its raw log-probability and its rank; ``[num_rows]`` int64, float32, int64. The
    reference of the op table's ``greedy_sample``."""
    token_ids = argmax_lowest(logits)  # [num_rows]
    out = _logprob_output(torch.log_softmax(logits.float(), dim=-1), token_ids, None)
    return token_ids, out.sampled_logprobs, out.sampled_ranks


def _logprob_output(raw_logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int | None) -> SamplerOutput:
    """Log-probability and rank of ``token_ids`` [num_rows] plus the top-n of ``raw_logprobs``."""
    token_logprobs = raw_logprobs.gather(1, token_ids[:, None])  # [num_rows, 1]
    # vLLM's rank: the number of tokens at least as likely as the chosen one (1 = most likely).
    ranks = (raw_logprobs >= token_logprobs).sum(dim=-1)  # [num_rows]
    top_ids = top_lps = None
    if num_logprobs is not None:
        top_lps, top_ids = top_n(raw_logprobs, num_logprobs)
    return SamplerOutput(token_ids, token_logprobs[:, 0], ranks, top_ids, top_lps)


def top_n(scores: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` best of each row, best first, equal scores by ascending id (a stable descending sort's first
    ``n``), without sorting the vocabulary: values and ids ``[num_rows, n]``.

    ``topk`` finds each row's n-th best value; every score above it is in, and of the scores equal to it the
    lowest ids fill the remaining places. The chosen ids, taken in ascending order, are then sorted stably.
    """
    rows, vocab = scores.shape
    n = min(n, vocab)
    if n == 0:
        return scores.new_empty(rows, 0), torch.empty(rows, 0, dtype=torch.int64, device=scores.device)
    nth = scores.topk(n, dim=-1).values[:, -1:]  # [num_rows, 1]
    above = scores > nth  # [num_rows, vocab]
    tied = scores == nth
    room = n - above.sum(dim=-1, keepdim=True)  # [num_rows, 1]: places left for the tied ids
    chosen = above | (tied & (tied.cumsum(dim=-1) <= room))  # exactly n per row
    ids = torch.arange(vocab, device=scores.device).expand(rows, vocab)
    ascending = torch.where(chosen, ids, vocab).topk(n, dim=-1, largest=False).values  # sorted: smallest first
    values = scores.gather(1, ascending)  # [num_rows, n], by ascending id
    order = values.sort(dim=-1, descending=True, stable=True).indices
    return values.gather(1, order), ascending.gather(1, order)


__all__ = [
    "PromptLogprobsOutput",
    "RowKinds",
    "SamplerOutput",
    "SamplingMetadata",
    "apply_logits_controls",
    "apply_min_p",
    "apply_penalties",
    "apply_top_k_top_p",
    "argmax_lowest",
    "compute_prompt_logprobs",
    "logprob_output",
    "processed_logits",
    "request_seed",
    "sample",
    "sampling_probs",
    "token_counts",
]

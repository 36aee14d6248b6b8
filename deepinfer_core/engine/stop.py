"""When a request stops on its tokens: one pure function of the request's parameters and its generated ids.

Rules (as vLLM's ``check_stop``):

* EOS (unless ``ignore_eos``) and ``stop_token_ids`` give ``finish_reason="stop"``; ``stop_reason`` is the stop
  token id (None for EOS). Neither counts at a token whose 1-based index is <= ``min_tokens`` (the sampler masks
  them there too).
* ``max_tokens`` generated tokens, or ``max_model_len`` tokens in all, give ``finish_reason="length"`` unless the
  same token also stops it.

Stop strings need the text and are matched by the output processor (``engine/output_processor.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer_core.outputs import FINISH_LENGTH, FINISH_STOP
from deepinfer_core.sampling.params import SamplingParams

StopDecision = tuple[str, int | str | None]  # (finish_reason, stop_reason)


def check_stop(params: SamplingParams, num_prompt_tokens: int, output_token_ids: Sequence[int],
               eos_token_id: int | None, max_model_len: int | None) -> StopDecision | None:
    """Whether the last of ``output_token_ids`` (the generated ids so far) ends the request, and why; None if it
    goes on."""
    num_output = len(output_token_ids)
    if num_output == 0:
        return None
    last = int(output_token_ids[-1])
    if num_output > params.min_tokens:
        if eos_token_id is not None and last == eos_token_id and not params.ignore_eos:
            return FINISH_STOP, None
        if last in params.stop_token_ids:
            return FINISH_STOP, last
    if reaches_length_limit(params, num_prompt_tokens, num_output, max_model_len):
        return FINISH_LENGTH, None
    return None


def reaches_length_limit(params: SamplingParams, num_prompt_tokens: int, num_output: int,
                         max_model_len: int | None) -> bool:
    """Whether ``num_output`` generated tokens end the request by length (``max_tokens`` or ``max_model_len``)."""
    return ((params.max_tokens is not None and num_output >= params.max_tokens)
            or (max_model_len is not None and num_prompt_tokens + num_output >= max_model_len))

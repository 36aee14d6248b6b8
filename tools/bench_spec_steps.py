"""Times the speculative-decoding steps (#33 point 6): the verify step (the target computing ``n`` tokens per sequence
through the static path: ``n = 1`` is the plain decode graph and greedy sampling, ``n > 1`` the verification graph
of ``engine/verify_graphs.py`` (its draft-row save inside), the greedy verification of ``n - 1`` drafts per sequence
and the rollback; the graph replay alone is printed beside) and the MTP draft step (the draft
layer folding one verified row per sequence, then drafting ``n`` tokens: the static round of
``deepinfer_dspark/draft_graphs.py`` with its host-side placement and upload, its graph replay alone, and the eager
round beside), for ``n`` in ``--tokens`` at the batch sizes of ``--batch``, every sequence ``--context`` tokens long.
On a GPU the static steps replay CUDA graphs. The sequences' state is whatever the pools hold (shapes and work are a
real step's; the tokens are random); the host's per-step work (scheduling, building the sampling metadata, reading
the results) is not in the times. The engine's ``max_model_len`` is the context bucket of ``--context`` plus a
step's tokens (a power of two), so the state holds every sequence's padded block table at the largest batch.

From the step times it prints the speedup they give at ``--acceptance`` tokens per step (computed, not measured):
``acceptance * decode(1) / (draft(k) + verify(k + 1))`` for ``k`` drafts.

    python tools/bench_spec_steps.py --preset v4-flash-8l64e-mtp --batch 1 16 64 --tokens 1 2 3 4 5 6
    python tools/bench_spec_steps.py --batch 1 4 --tokens 1 2 3 --iters 3   # the embedded tiny model (CPU: slow)
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.sampling.sampler import SamplingMetadata, sample
from deepinfer_core.spec_decode.verify import verify


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    folder = args.model
    if args.preset:
        from deepinfer_core.bench.presets import ensure_preset

        folder = str(ensure_preset(args.preset, device="cuda" if torch.cuda.is_available() else None))
    k = max(args.tokens)
    llm = LLM(folder, speculative_config={"method": args.method, "num_speculative_tokens": k}, dtype=args.dtype,
              max_num_seqs=max(args.batch), cuda_graph_sizes=sorted(args.batch),
              max_model_len=_max_model_len(args.context, k), enable_prefix_caching=False)
    runner = llm.engine.runner
    if runner.verify_graphs is None:
        raise SystemExit("no verification graphs: the model or backend has no static steps (or enforce_eager)")
    rows = []
    for batch in args.batch:
        for n in args.tokens:
            forward_ms, verify_ms = _verify_ms(llm, batch, n, args)
            row = {"batch": batch, "tokens": n, "forward_ms": forward_ms, "verify_ms": verify_ms, "draft_ms": None}
            if args.method in ("mtp", "dspark"):
                row.update(_draft_ms(llm, batch, n, args))
            rows.append(row)
            print(f"batch {batch:4d}  tokens/seq {n}  verify {verify_ms:8.3f} ms (graph {forward_ms:8.3f} ms)"
                  + (f"  draft {row['draft_ms']:8.3f} ms (graph {row['draft_replay_ms']:8.3f} ms, eager "
                     f"{row['draft_eager_ms']:8.3f} ms)" if row["draft_ms"] is not None else ""), flush=True)
    result = {"model": folder, "backend": llm.backend.name, "dtype": args.dtype, "context": args.context,
              "rows": rows, "computed_speedup": _speedups(rows, args.acceptance)}
    for entry in result["computed_speedup"]:
        print(f"computed: batch {entry['batch']:4d}  k {entry['k']}  at acceptance {args.acceptance}: "
              f"{entry['speedup']:.2f}x over decode")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded tiny model)")
    p.add_argument("--preset", default=None, help="a bench preset (deepinfer_core/bench/presets.py), e.g. "
                                                 "v4-flash-8l64e-mtp")
    p.add_argument("--method", default="mtp", help="speculative method whose steps are timed (ngram: no draft step)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6],
                   help="tokens per sequence of the verify step, and draft tokens of the draft step")
    p.add_argument("--context", type=int, default=1024, help="tokens already in every sequence")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--acceptance", type=float, default=3.5, help="tokens per step for the computed speedup")
    p.add_argument("--json", default=None, help="write the results here")
    return p


def _host_batch(llm, batch: int, tokens: int, context: int, padded_to: int) -> ForwardBatch:
    """``batch`` sequences in slots ``0..batch-1``, each with its own blocks, ``tokens`` random tokens from position
    ``context``; ``padded_to`` blocks per table (the static step's context bucket), filled with real blocks."""
    state, vocab = llm.engine.runner.state, llm.model.vocab_size
    per_seq = -(-padded_to // state.block_size)
    if batch * per_seq >= state.num_blocks:
        raise SystemExit(f"{batch} sequences of {padded_to} tokens need {batch * per_seq} blocks; the state has "
                         f"{state.num_blocks}: lower --context or --batch")
    return ForwardBatch(
        input_ids=torch.randint(vocab, (batch * tokens,)),
        positions=(torch.full((batch, 1), context) + torch.arange(tokens)).flatten(),
        query_start=list(range(0, (batch + 1) * tokens, tokens)),
        context_lens=[context] * batch,
        slots=list(range(batch)),
        block_tables=[list(range(s * per_seq, (s + 1) * per_seq)) for s in range(batch)],
        logits_rows=torch.arange(batch * tokens),
        compressed_write_start=[0] * batch,
        sliding_floor=[0] * batch,
    )


def _verify_ms(llm, batch: int, tokens: int, args) -> tuple[float, float]:
    """One step computing ``tokens`` per sequence, (the graph replay alone, the step): the decode graph and greedy
    sampling (1), or the verification graph, the greedy verification of ``tokens - 1`` drafts per sequence and the
    rollback (> 1). The sampling metadata is built once, outside the timed calls."""
    runner = llm.engine.runner
    greedy = llm.model.ops.greedy_sample
    drafts = [[1] * (tokens - 1)] * batch
    metadata = _greedy_metadata(batch * tokens, llm.model.device)
    if tokens == 1:
        graphs = runner.decode_graphs
        bucket = graphs.context_bucket(args.context + 1)
        step = graphs.captured.get((batch, bucket)) or graphs._capture(batch, bucket)
        graphs._place_inputs(_host_batch(llm, batch, 1, args.context, bucket), step.shape, step.buffers)

        def decode_step() -> None:
            step.replay()
            sample(graphs.logits[:batch], metadata, greedy=greedy)

        return _time(step.replay, args), _time(decode_step, args)
    graphs = runner.verify_graphs
    bucket = graphs.context_bucket(args.context + tokens)
    step = graphs.captured.get((batch, bucket, tokens)) or graphs._capture(batch, bucket, tokens)
    graphs._place(_host_batch(llm, batch, tokens, args.context, bucket), bucket, step.buffers)
    base = torch.full((batch,), args.context, dtype=torch.long, device=llm.model.device)

    def verify_step() -> None:
        step.replay()
        verified = verify(graphs.logits[:batch * tokens], metadata, drafts, greedy=greedy)
        llm.model.rollback_draft_state(runner.state, step.saved["rows"], base + verified.num_emitted)

    return _time(step.replay, args), _time(verify_step, args)


def _greedy_metadata(rows: int, device: torch.device) -> SamplingMetadata:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return SamplingMetadata.from_params([params] * rows, seeds=[0] * rows, prompt_token_ids=[[1]] * rows,
                                        output_token_ids=[[]] * rows, device=device)


def _max_model_len(context: int, k: int) -> int:
    """The context bucket of a ``context``-token sequence after a step of ``k + 1`` tokens (the power of two the
    decode and verification graphs pad its block table to), at least ``context + 256``."""
    from deepinfer_core.engine.decode_graphs import MIN_CONTEXT_BUCKET

    return max(context + 256, MIN_CONTEXT_BUCKET, 1 << (context + k).bit_length())


def _draft_ms(llm, batch: int, tokens: int, args) -> dict:
    """The MTP draft step, folding one verified row per sequence, then drafting ``tokens`` tokens: ``draft_ms`` the
    static round (host placement, upload, hidden-state gather, replay), ``draft_replay_ms`` its graph replay
    alone, ``draft_eager_ms`` the eager round."""
    from deepinfer_dspark.draft_graphs import DraftGraphs

    from deepinfer_core.models.deepseek_v4.mtp import StaticRows

    proposer = llm.engine.speculator.proposer
    draft, device = proposer.draft, llm.model.device
    forward = ForwardBatch.build([[1]] * batch, [args.context] * batch, list(range(batch)), [[] for _ in range(batch)],
                                 device=device)
    streams = llm.model.config.hc_mult
    hidden = torch.randn(batch, streams, llm.model.config.hidden_size, dtype=llm.model.dtype, device=device) * 0.02
    eager_ms = _time(lambda: draft.propose(forward, proposer.state, hidden, tokens), args)
    graphs = DraftGraphs(draft, proposer.state, llm.backend.capture_graph, sorted(args.batch), tokens,
                         proposer.spare_slot)
    rows = StaticRows([[1]] * batch, [args.context] * batch, list(range(batch)), [0] * batch)
    if graphs.run(rows, hidden) is None:
        raise SystemExit(f"draft graph capture failed: {graphs.disabled_reason}")
    step = graphs.captured[(batch, 1)]
    return {"draft_ms": _time(lambda: graphs.run(rows, hidden), args), "draft_replay_ms": _time(step.replay, args),
            "draft_eager_ms": eager_ms}


def _time(fn, args) -> float:
    """Mean milliseconds of ``fn`` over ``args.iters`` calls after ``args.warmup``, the device synchronised."""
    cuda = torch.cuda.is_available()
    for _ in range(args.warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.iters):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000 / args.iters


def _speedups(rows: list[dict], acceptance: float) -> list[dict]:
    """``acceptance * decode / (draft(k) + verify(k + 1))`` per batch and ``k`` with both times measured, for the
    ``k`` that can reach ``acceptance`` tokens per step (``k + 1 >= acceptance``)."""
    out = []
    by_key = {(r["batch"], r["tokens"]): r for r in rows}
    for (batch, k), row in sorted(by_key.items()):
        decode, verify = by_key.get((batch, 1)), by_key.get((batch, k + 1))
        if decode is None or verify is None or row["draft_ms"] is None or k + 1 < acceptance:
            continue
        step = row["draft_ms"] + verify["verify_ms"]
        out.append({"batch": batch, "k": k, "step_ms": step, "speedup": acceptance * decode["verify_ms"] / step})
    return out


if __name__ == "__main__":
    main()

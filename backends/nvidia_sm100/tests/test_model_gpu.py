"""End to end on the GPU: ``LLM(backend="nvidia_sm100")`` against the CPU reference path (marker ``nvidia``).

Checkpoint: ``$DEEPINFER_TINY_CHECKPOINT``, else ``deepinfer_core/assets/tiny_v4`` if shipped, else a tiny
random checkpoint written by ``tests/v4_factory.py`` (needs transformers with DeepSeek-V4).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from deepinfer_nvidia_sm100 import envs

pytestmark = pytest.mark.nvidia

REPO = Path(__file__).resolve().parents[3]
STEPS = 64
PROMPTS = [[1, 5, 9, 13, 2], list(range(3, 40)), [7] * 11 + list(range(20, 60, 3)), [11, 3, 8, 60, 2, 4, 33]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    given = envs.DEEPINFER_TINY_CHECKPOINT
    if given is not None:
        return given
    shipped = REPO / "deepinfer_core" / "assets" / "tiny_v4"
    if (shipped / "config.json").exists():
        return shipped
    pytest.importorskip("transformers")
    sys.path.insert(0, str(REPO / "tests"))
    from v4_factory import tiny_checkpoint

    folder = tmp_path_factory.mktemp("tiny_v4")
    tiny_checkpoint(folder, seed=0, hc_mult=4, num_hash_layers=1)
    return folder


def _generate(folder, backend, dtype, replays=None, backends=None, **llm_kwargs):
    """Greedy steps per prompt: (token, its logprob, top-2 gap). ``replays`` (a list) gets the number of
    decode steps replayed from CUDA graphs, ``backends`` (a list) the engine's backend."""
    from deepinfer_core.llm import LLM
    from deepinfer_core.sampling.params import SamplingParams

    llm = LLM(model=str(folder), backend=backend, dtype=dtype, max_model_len=256, max_num_seqs=8, **llm_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    name = llm.backend.name
    if backends is not None:
        backends.append(llm.backend)
    if replays is not None:
        graphs = llm.engine.runner.decode_graphs
        replays.append(graphs.num_replays if graphs is not None else 0)
    llm.engine.shutdown()
    result = []
    for out in outs:
        comp = out.outputs[0]
        steps = []
        for token, lps in zip(comp.token_ids, comp.logprobs, strict=True):
            steps.append((token, lps[token].logprob, _top2_gap(lps)))
        result.append(steps)
    return name, result


def _top2_gap(logprobs) -> float:
    """The best two log-probabilities' difference (how near the greedy choice is to a tie)."""
    ranked = sorted(logprobs.values(), key=lambda lp: -lp.logprob)
    return ranked[0].logprob - (ranked[1].logprob if len(ranked) > 1 else float("-inf"))


@pytest.fixture(scope="module")
def cpu_reference(checkpoint):
    return _generate(checkpoint, "cpu", "float32")[1]


def _scored(folder, dtype, sequences):
    """Teacher forcing: each sequence run as a prompt on the GPU backend; per sequence, the logprob of each token
    after the first (``prompt_logprobs``)."""
    from deepinfer_core.llm import LLM
    from deepinfer_core.sampling.params import SamplingParams

    llm = LLM(model=str(folder), backend="nvidia_sm100", dtype=dtype, max_model_len=256, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    llm.engine.shutdown()
    return [[lps[token].logprob for token, lps in zip(seq[1:], out.prompt_logprobs[1:], strict=True)]
            for seq, out in zip(sequences, outs, strict=True)]


def _compare(want, got, lp_tol, tie_gap, label, steps=STEPS):
    """Tokens equal until a near-tie of ``want`` (then the sequences may part); logprobs within ``lp_tol``.
    Returns (tokens compared, max |logprob difference|)."""
    compared, worst = 0, 0.0
    for p, (w_steps, g_steps) in enumerate(zip(want, got, strict=True)):
        assert len(g_steps) == steps
        for step, ((w_tok, w_lp, w_gap), (g_tok, g_lp, _)) in enumerate(zip(w_steps, g_steps)):
            if w_tok != g_tok:  # allowed only at a near-tie of the CPU reference; the rest then diverges
                assert w_gap < tie_gap, f"{label} prompt {p} step {step}: {g_tok} != {w_tok} (top-2 gap {w_gap:.4g})"
                print(f"[{label}] prompt {p}: near-tie divergence at step {step} (gap {w_gap:.3g})")
                break
            worst = max(worst, abs(w_lp - g_lp))
            compared += 1
            assert abs(w_lp - g_lp) < lp_tol, f"{label} prompt {p} step {step}: logprob {g_lp} vs {w_lp}"
    print(f"[{label}] compared {compared} tokens, max |logprob diff| {worst:.3g}")
    return compared, worst


def test_fp32_greedy_and_logprobs_match_cpu(checkpoint, cpu_reference):
    replays = []
    name, gpu = _generate(checkpoint, "nvidia_sm100", "float32", replays)
    assert name == "nvidia_sm100"
    assert replays[0] >= STEPS - 1, "decode steps should replay CUDA graphs by default"
    compared, _ = _compare(cpu_reference, gpu, lp_tol=2e-3, tie_gap=1e-3, label="gpu fp32 (graphs) vs cpu fp32")
    assert compared >= STEPS * len(PROMPTS) // 2


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-3), ("bfloat16", 0.05)])
def test_cuda_graph_decode_matches_eager(checkpoint, dtype, tol):
    """The captured static-shape decode step against the eager dynamic step on the same GPU."""
    replays = []
    _, eager = _generate(checkpoint, "nvidia_sm100", dtype, replays, enforce_eager=True)
    _, graphs = _generate(checkpoint, "nvidia_sm100", dtype, replays)
    assert replays == [0, replays[1]] and replays[1] >= STEPS - 1
    compared, _ = _compare(eager, graphs, lp_tol=tol, tie_gap=tol, label=f"gpu {dtype}: graphs vs eager")
    assert compared >= STEPS * len(PROMPTS) // 2


def _lone_prompts(folder, dtype, **llm_kwargs):
    """Three lone prompts past the sliding ring (130, 256, 301 tokens), each prefilled in a step of its own, then 32
    greedy steps: per prompt (token, logprob, top-2 gap), and the prefill graphs' replays."""
    import torch

    from deepinfer_core.llm import LLM
    from deepinfer_core.sampling.params import SamplingParams

    llm = LLM(model=str(folder), backend="nvidia_sm100", dtype=dtype, max_model_len=600, max_num_seqs=2, **llm_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    result = []
    for length in (130, 256, 301):
        ids = torch.randint(50, 4000, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        comp = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
        result.append([(t, lps[t].logprob, _top2_gap(lps)) for t, lps in zip(comp.token_ids, comp.logprobs,
                                                                             strict=True)])
    graphs = llm.engine.runner.prefill_graphs
    llm.engine.shutdown()
    return result, graphs.num_replays if graphs is not None else 0


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-3), ("bfloat16", 0.05)])
def test_prefill_graph_matches_eager_prefill(checkpoint, dtype, tol):
    """Lone prompts through the captured prefill graphs of 256 / 512 tokens (padded) against eager prefill steps on
    the same GPU (decode steps replay graphs in both): greedy tokens equal until a near-tie, logprobs within
    ``tol``."""
    eager, none = _lone_prompts(checkpoint, dtype, prefill_graph_buckets=[])
    graphs, replays = _lone_prompts(checkpoint, dtype, prefill_graph_buckets=[256, 512])
    assert none == 0 and replays == 3
    compared, _ = _compare(eager, graphs, lp_tol=tol, tie_gap=tol, label=f"gpu {dtype}: prefill graphs vs eager",
                           steps=32)
    assert compared >= 32 * 3 // 2


@pytest.mark.parametrize("graphs", [True, False])
def test_async_scheduling_matches_sync(checkpoint, graphs):
    """Steps launched before the last step's tokens are read (the backend's default) against steps that wait:
    the same batches run, so the same tokens and logprobs, with an early stop that wastes a row in the mix."""
    from deepinfer_core.llm import LLM
    from deepinfer_core.sampling.params import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=STEPS // 2, ignore_eos=True, logprobs=1)
    runs = {}
    for overlap in (False, True):
        llm = LLM(model=str(checkpoint), backend="nvidia_sm100", dtype="float32", max_model_len=256, max_num_seqs=8,
                  enforce_eager=not graphs, async_scheduling=overlap)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        first = llm.generate(prompts, [greedy, seeded, greedy, seeded], use_tqdm=False)
        stop = first[0].outputs[0].token_ids[STEPS // 4]
        early = SamplingParams(temperature=0.0, max_tokens=STEPS, stop_token_ids=[stop], logprobs=1)
        second = llm.generate(prompts, [early, greedy, seeded, early], use_tqdm=False)
        runs[overlap] = (first + second, llm.engine.num_overlapped_steps, llm.engine.num_steps)
        llm.engine.shutdown()
    (want, none, _), (got, overlapped, steps) = runs[False], runs[True]
    assert none == 0 and overlapped == steps - 2  # every step but the first of each generate call
    for a, b in zip(want, got, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        assert (y.token_ids, y.finish_reason) == (x.token_ids, x.finish_reason)
        for la, lb in zip(x.logprobs, y.logprobs, strict=True):
            # a wasted row changes one step's batch: eager GEMMs may then sum in another order (fp32)
            assert la.keys() == lb.keys() and all(abs(la[t].logprob - lb[t].logprob) < 2e-4 for t in la)
    assert any(o.outputs[0].finish_reason == "stop" for o in got)


def test_compiled_decode_step_matches_eager(checkpoint, monkeypatch):
    """DEEPINFER_NVIDIA_COMPILE_STEP=1: decode steps compiled by TorchInductor, then captured, against eager steps."""
    replays = []
    _, eager = _generate(checkpoint, "nvidia_sm100", "bfloat16", replays, enforce_eager=True)
    monkeypatch.setenv("DEEPINFER_NVIDIA_COMPILE_STEP", "1")
    backends = []
    _, compiled = _generate(checkpoint, "nvidia_sm100", "bfloat16", replays, backends)
    assert backends[0]._step_compiler.failure is None  # a failed compile would replay uncompiled steps
    assert replays == [0, replays[1]] and replays[1] >= STEPS - 1
    compared, _ = _compare(eager, compiled, lp_tol=0.05, tie_gap=0.05, label="gpu bf16: compiled graphs vs eager")
    assert compared >= STEPS * len(PROMPTS) // 2


@pytest.mark.xfail(strict=False, reason=(
    "open (docs/nvidia.md): on the H200 the bf16 run with the Triton moe_experts leaves the reference ops' "
    "bf16 envelope once (prompt 2, decode step 5: logprob -2.03 vs -1.60, tol 0.22) while fp32 matches to 5e-6; "
    "suspected an internal near-tie (expert / indexer top-k) flipped by GEMM accumulation order; not yet shown"))
def test_bf16_within_the_reference_ops_own_bf16_error(checkpoint, cpu_reference, monkeypatch):
    """bf16 tolerance is measured, not guessed: the reference ops run in bf16 (on the CPU, and on this GPU
    with no overrides) set the envelope. This tiny random model has flat distributions and 4 experts top-2,
    so bf16 rounding alone moves logprobs by tenths and can flip an expert choice."""
    from deepinfer_nvidia_sm100.backend import NvidiaBackend

    inf = float("inf")
    _, cpu_bf16 = _generate(checkpoint, "cpu", "bfloat16")
    _, cpu_err = _compare(cpu_reference, cpu_bf16, lp_tol=inf, tie_gap=inf, label="cpu bf16 reference ops")
    with monkeypatch.context() as m:
        m.setattr(NvidiaBackend, "op_overrides", lambda self: {})
        _, gpu_ref = _generate(checkpoint, "nvidia_sm100", "bfloat16")
    _, gpu_ref_err = _compare(cpu_reference, gpu_ref, lp_tol=inf, tie_gap=inf, label="gpu bf16 reference ops")
    tol = 1.5 * max(cpu_err, gpu_ref_err) + 0.05
    _, gpu = _generate(checkpoint, "nvidia_sm100", "bfloat16")
    compared, _ = _compare(cpu_reference, gpu, lp_tol=tol, tie_gap=tol, label=f"gpu bf16 (tol {tol:.3g})")
    assert compared >= len(PROMPTS)


def _prefill_attention(ops):
    """The ``sink_attention`` that takes prefill rows in ``ops`` (behind the Triton decode kernel's wrapper, if on)."""
    attention = ops.get("sink_attention")
    return getattr(attention, "fallback", attention)


def test_tilelang_attention_inside_the_model_matches_the_reference_attention(tmp_path, monkeypatch):
    """A tiny model with V4's attention shape (64 heads x 512, so the TileLang ``sink_attention`` takes the
    model's calls), bf16, decode graphs on: greedy tokens and logprobs against the same run with the reference
    attention (``DEEPINFER_NVIDIA_TILELANG=0``) until the runs part at a near-tie; then every position of the
    reference run's sequences, scored as prompts (teacher forcing, the prefill kernels) with either attention."""
    pytest.importorskip("tilelang")
    pytest.importorskip("transformers")
    from deepinfer_nvidia_sm100.backend import sm90_ops
    from deepinfer_nvidia_sm100.kernels import tl_attention

    from deepinfer_core.ops import reference as ref

    sys.path.insert(0, str(REPO / "tests"))
    from v4_factory import tiny_checkpoint

    tiny_checkpoint(tmp_path, seed=0, hc_mult=4, num_attention_heads=64, head_dim=512, o_groups=8,
                    partial_rotary_factor=0.125, index_head_dim=64)  # V4: RoPE on 64 of 512 dims
    assert _prefill_attention(sm90_ops()) is tl_attention.sink_attention
    replays = []
    _, with_kernel = _generate(tmp_path, "nvidia_sm100", "bfloat16", replays)
    monkeypatch.setenv("DEEPINFER_NVIDIA_TILELANG", "0")
    assert _prefill_attention(sm90_ops()) in (None, ref.sink_attention)
    _, reference = _generate(tmp_path, "nvidia_sm100", "bfloat16")
    assert replays[0] >= STEPS - 1
    compared, _ = _compare(reference, with_kernel, lp_tol=0.05, tie_gap=0.05, label="TileLang vs reference attention")
    assert compared >= len(PROMPTS)  # greedy runs may part at a near-tie (bf16 ties are common): then teacher forcing
    sequences = [prompt + [token for token, _, _ in steps] for prompt, steps in zip(PROMPTS, reference, strict=True)]
    scored_reference = _scored(tmp_path, "bfloat16", sequences)
    monkeypatch.delenv("DEEPINFER_NVIDIA_TILELANG")
    scored_kernel = _scored(tmp_path, "bfloat16", sequences)
    worst = max(abs(k - r) for ks, rs in zip(scored_kernel, scored_reference, strict=True)
                for k, r in zip(ks, rs, strict=True))
    print(f"[TileLang vs reference attention] teacher-forced {sum(map(len, sequences)) - len(sequences)} positions, "
          f"max |logprob diff| {worst:.3g}")
    assert worst < 0.05


@pytest.mark.parametrize("mode", ["1", "gather"])
@pytest.mark.parametrize("dtype,tol,shape", [
    ("float32", 2e-3, {"num_attention_heads": 16}),  # 16 heads: the sparse kernel's head block
    ("bfloat16", 0.05, {"num_attention_heads": 64, "head_dim": 512, "o_groups": 8, "partial_rotary_factor": 0.125,
                        "index_head_dim": 64}),  # V4's attention shape: the TileLang kernel takes the rows
])
def test_sparse_csa_attention_matches_dense(tmp_path, monkeypatch, dtype, tol, shape, mode):
    """``DEEPINFER_SPARSE_CSA_ATTENTION=1`` (each query row's window and top-k entries read in place by index:
    ``kernels/sparse_attention.py``) and ``gather`` (the same keys gathered per row) against the dense masked
    attention, with an ``index_topk`` of 4 so the indexer selects past 16 tokens (prefill chunks, eager and captured
    decode steps)."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(REPO / "tests"))
    from v4_factory import tiny_checkpoint

    tiny_checkpoint(tmp_path, seed=0, hc_mult=4, index_topk=4, **shape)
    monkeypatch.setenv("DEEPINFER_SPARSE_CSA_ATTENTION", "0")
    _, dense = _generate(tmp_path, "nvidia_sm100", dtype)
    monkeypatch.setenv("DEEPINFER_SPARSE_CSA_ATTENTION", mode)
    replays = []
    _, sparse = _generate(tmp_path, "nvidia_sm100", dtype, replays)
    assert replays[0] >= STEPS - 1
    compared, _ = _compare(dense, sparse, lp_tol=tol, tie_gap=tol, label=f"gpu {dtype}: sparse ({mode}) vs dense CSA")
    assert compared >= len(PROMPTS)


@pytest.fixture(scope="module")
def quantized_checkpoint(checkpoint, tmp_path_factory) -> Path:
    """The tiny checkpoint as DeepSeek ships V4.1-Flash: MXFP4 experts, fp8 linears in 32 x 32 ue8m0 blocks."""
    from deepinfer_core.quant.writer import QuantRecipe, quantize_checkpoint

    folder = tmp_path_factory.mktemp("tiny_v4_fp4") / "q"
    quantize_checkpoint(checkpoint, folder, QuantRecipe("fp4", "fp8", 32))
    return folder


def test_quantized_checkpoint_runs_the_quantized_kernels_in_cuda_graphs(quantized_checkpoint):
    """fp32 on the GPU (the MXFP4 expert and fp8 linear kernels, decode steps replayed from CUDA graphs: the kernels
    never synchronise with the host) against the CPU's dequantizing reference ops on the same stored bytes."""
    replays = []
    _, cpu = _generate(quantized_checkpoint, "cpu", "float32")
    backends = []
    _, gpu = _generate(quantized_checkpoint, "nvidia_sm100", "float32", replays, backends)
    sources = backends[0].make_op_table().sources()
    assert sources["moe_experts_mxfp4"] == sources["linear_fp8_block"] == "nvidia_sm100"
    assert replays[0] >= STEPS - 1, "decode steps of a quantized model should replay CUDA graphs"
    compared, _ = _compare(cpu, gpu, lp_tol=2e-3, tie_gap=1e-3, label="quantized: gpu fp32 (graphs) vs cpu fp32")
    assert compared >= STEPS * len(PROMPTS) // 2


def test_fp8_tensor_core_prefill_against_weight_only(quantized_checkpoint, monkeypatch):
    """bf16 lone prompts of 130-301 tokens (prefill products of at least ``FP8_TC_MIN_ROWS`` rows take the fp8
    tensor cores, activations quantized) against the same run with ``DEEPINFER_NVIDIA_FP8_TC=0`` (weight-only,
    activations as they are): the greedy agreement and largest logprob difference the activation quantization
    costs, printed; tokens equal until a near-tie."""
    tensor_cores, _ = _lone_prompts(quantized_checkpoint, "bfloat16")
    monkeypatch.setenv("DEEPINFER_NVIDIA_FP8_TC", "0")
    weight_only, _ = _lone_prompts(quantized_checkpoint, "bfloat16")
    compared, _ = _compare(weight_only, tensor_cores, lp_tol=0.25, tie_gap=0.25,
                           label="quantized bf16: fp8 tensor-core prefill vs weight-only", steps=32)
    assert compared >= 32 * 3 // 2


def _speculative(folder, dtype, config, **llm_kwargs):
    """``_generate``'s steps with ``speculative_config=config``, and (verification graph replays, per tokens per
    sequence; decode graph replays; accepted draft tokens; MTP draft graph replays)."""
    from deepinfer_core.llm import LLM
    from deepinfer_core.sampling.params import SamplingParams

    llm = LLM(model=str(folder), backend="nvidia_sm100", dtype=dtype, max_model_len=256, max_num_seqs=8,
              speculative_config=config, **llm_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    runner = llm.engine.runner
    verify, decode = runner.verify_graphs, runner.decode_graphs
    counts = (verify.num_replays if verify else 0, dict(verify.replays_by_tokens) if verify else {},
              decode.num_replays if decode else 0,
              {m.name: m.value for m in llm.get_metrics()}["deepinfer:spec_decode_num_accepted_tokens"],
              getattr(getattr(llm.engine.speculator.proposer, "graphs", None), "num_replays", 0))
    llm.engine.shutdown()
    steps = [[(t, lps[t].logprob, _top2_gap(lps)) for t, lps in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                                                     strict=True)] for o in outs]
    return steps, counts


def _has_draft_layers(folder) -> bool:
    import json

    return json.loads((Path(folder) / "config.json").read_text()).get("num_nextn_predict_layers", 0) > 0


@pytest.mark.parametrize("method,dtype,tol", [("ngram", "float32", 2e-3), ("ngram", "bfloat16", 0.05),
                                              ("mtp", "float32", 2e-3)])
def test_cuda_graph_verification_matches_eager_verification(checkpoint, method, dtype, tol):
    """Speculative decoding with verification steps replayed from CUDA graphs (``engine/verify_graphs.py``: T tokens
    per sequence, padding rolled back like rejected drafts) against eager verification on the same GPU."""
    if method == "mtp":
        pytest.importorskip("deepinfer_dspark")
        if not _has_draft_layers(checkpoint):
            pytest.skip("the checkpoint has no mtp.* draft layers")
    config = {"method": method, "num_speculative_tokens": 5}
    if method == "ngram":
        config["prompt_lookup_max"] = 3
    eager, eager_counts = _speculative(checkpoint, dtype, config, enforce_eager=True)
    graphs, counts = _speculative(checkpoint, dtype, config)
    assert eager_counts[0] == 0 and counts[0] > 0, f"verification graphs replayed {counts}"
    if method == "mtp":  # the draft rounds replay their graphs too
        assert eager_counts[4] == 0 and counts[4] > 0, f"draft graphs replayed {counts}"
    print(f"[{method} {dtype}] verification replays by tokens per sequence {counts[1]}, decode replays {counts[2]}, "
          f"accepted drafts {counts[3]} (eager {eager_counts[3]}), draft graph replays {counts[4]}")
    compared, _ = _compare(eager, graphs, lp_tol=tol, tie_gap=tol, label=f"gpu {dtype} {method}: graphs vs eager")
    assert compared >= STEPS * len(PROMPTS) // 2


def _target_hidden(model, tokens):
    """The target's last streams over ``tokens`` (``[T, hc, D]``: what the engine hands an MTP proposer)."""
    from deepinfer_core.forward_batch import ForwardBatch

    state = model.new_state(1, 64)
    blocks = list(range(-(-len(tokens) // state.block_size)))
    batch = ForwardBatch.build([tokens], [0], [0], [blocks], logits="all", device=model.device)
    return model.forward(batch, state, return_hidden=True).final_hidden


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 0.05)])
def test_cuda_graph_drafts_match_eager_drafts(checkpoint, dtype, tol):
    """MTP draft rounds replayed from CUDA graphs (``deepinfer_dspark/draft_graphs.py``: the fold and all k draft
    tokens in one graph) against eager rounds of the same draft layer on the GPU: 4 sequences (slots 5, 0, 2, 7),
    a prompt round (eager on both sides: more rows than a graph folds), then 5 rounds of 1 .. k + 1 fold rows per
    sequence at batch 4, 1 and 3 (padded to 4); fp32 tokens equal and confidences within ``tol``, bf16 tokens at
    least 90% equal; the draft rings after every round within ``tol``."""
    pytest.importorskip("deepinfer_dspark")
    if not _has_draft_layers(checkpoint):
        pytest.skip("the checkpoint has no mtp.* draft layers")
    import torch
    from deepinfer_dspark import MtpProposer

    from deepinfer_core.llm import LLM
    from deepinfer_core.sampling.params import SamplingParams
    from deepinfer_core.spec_decode.proposer import DraftBatch, DraftSequence

    k = 5
    llm = LLM(model=str(checkpoint), backend="nvidia_sm100", dtype=dtype, max_model_len=256, max_num_seqs=8,
              speculative_config={"method": "mtp", "num_speculative_tokens": k})
    graphed = llm.engine.speculator.proposer
    assert graphed.graphs is not None, "the engine replays graphs but the proposer drafts eagerly"
    eager = MtpProposer(graphed.config, llm.model, draft=graphed.draft)
    eager.allocate(8)
    vocab = llm.model.vocab_size
    sequences = [(p * 30)[:100] for p in PROMPTS]
    sequences = [[t % vocab for t in seq] for seq in sequences]
    hidden = [_target_hidden(llm.model, seq) for seq in sequences]
    slots, ends = (5, 0, 2, 7), [len(p) for p in PROMPTS]
    rounds = [[0, 1, 2, 3], [0, 1, 2, 3], [2], [0, 1, 3], [0, 1, 2, 3], [1, 3]]
    agree = total = 0
    for step, movers in enumerate(rounds):
        seqs = []
        for s in movers:
            first = 0 if step == 0 else ends[s]
            end = ends[s] if step == 0 else ends[s] + 1 + (step + s) % (k + 1)
            seqs.append(DraftSequence(f"r{s}", slots[s], sequences[s][:end + 1], end, first, hidden[s][first:end], 0,
                                      SamplingParams(), k))
            ends[s] = end
        want, got = eager.propose(DraftBatch(seqs)), graphed.propose(DraftBatch(seqs))
        for w, g in zip(want, got, strict=True):
            agree += sum(a == b for a, b in zip(w.token_ids, g.token_ids, strict=True))
            total += len(w.token_ids)
            if dtype == "float32":
                assert g.token_ids == w.token_ids, f"round {step}: graph {g.token_ids} vs eager {w.token_ids}"
                assert g.confidences == pytest.approx(w.confidences, abs=tol)
        for ring_e, ring_g in zip(eager.state.rings, graphed.state.rings, strict=True):
            torch.testing.assert_close(ring_g[:8].float(), ring_e[:8].float(), atol=tol, rtol=tol)
    assert graphed.graphs.num_replays >= len(rounds) - 1, f"draft graph replays {graphed.graphs.replays_by_rows}"
    print(f"[{dtype}] draft graphs by fold rows {graphed.graphs.replays_by_rows}; tokens equal {agree}/{total}")
    assert agree >= 0.9 * total
    llm.engine.shutdown()


LONG_PROMPT = 65_536
LONG_STEPS = 8
LONG_SCORED = 512  # the prompt's last positions whose logprobs are compared
LONG_TOL = 0.05  # the largest logprob difference: bounds indexer selection flips (the test's docstring)
LONG_TOL_MEDIAN = 1e-3
LONG_TIE_GAP = 0.02  # greedy tokens may part only where the reference's top-2 gap is below this
LONG_TOPK = 256  # of up to 16,384 CSA entries at 64K


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory) -> Path:
    """The tiny preset's layers (sliding, CSA, HCA, CSA; hidden 256; V4-Flash's compress rates 4 / 128 and window
    128) with 16 heads (the Triton sparse kernel's head block), ``index_topk`` ``LONG_TOPK``, and V4-Flash's
    1,048,576 positions with yarn RoPE on the compressed layers (the ``-1m`` presets'), random weights."""
    from deepinfer_core.bench import presets

    rope = {"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            "compress": {**presets.FLASH_COMPRESS_ROPE, "partial_rotary_factor": 0.25}}
    overrides = {"max_position_embeddings": presets.FLASH_MAX_POSITIONS, "rope_parameters": rope,
                 "num_attention_heads": 16, "index_topk": LONG_TOPK}
    return presets.ensure_preset("tiny", cache_dir=tmp_path_factory.mktemp("long"), overrides=overrides)


def _long_prompt_run(folder, backend: str, chunk: int):
    """One seeded prompt of ``LONG_PROMPT`` random ids prefilled in steps of ``chunk`` tokens, then ``LONG_STEPS``
    greedy tokens, fp32: ((token, logprob, top-2 gap) per step, the last ``LONG_SCORED`` prompt tokens' logprobs,
    decode graph replays)."""
    import torch

    from deepinfer_core.llm import LLM
    from deepinfer_core.sampling.params import SamplingParams

    prompt = torch.randint(3, 4096, (LONG_PROMPT,), generator=torch.Generator().manual_seed(64)).tolist()
    llm = LLM(model=str(folder), backend=backend, dtype="float32", max_model_len=LONG_PROMPT + 64, max_num_seqs=1,
              max_num_batched_tokens=chunk)
    assert llm.backend.name == backend
    params = SamplingParams(temperature=0.0, max_tokens=LONG_STEPS, ignore_eos=True, logprobs=2, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    graphs = llm.engine.runner.decode_graphs
    replays = graphs.num_replays if graphs is not None else 0
    llm.engine.shutdown()
    comp = out.outputs[0]
    steps = [(t, lps[t].logprob, _top2_gap(lps)) for t, lps in zip(comp.token_ids, comp.logprobs, strict=True)]
    scored = [lps[t].logprob for t, lps in zip(prompt[-LONG_SCORED:], out.prompt_logprobs[-LONG_SCORED:],
                                               strict=True)]
    return steps, scored, replays


@pytest.fixture(scope="module")
def long_cpu_reference(long_checkpoint):
    """The reference path at 64K: the CPU backend (reference ops) on the host's cores, its CSA layers through the
    reference ``sparse_sink_attention`` (``DEEPINFER_SPARSE_CSA_ATTENTION=1``: each row's window and selected
    entries gathered; the dense masked attention over every entry would take minutes at 64K), 1,024-token steps."""
    import torch

    from deepinfer_core.backends.host_threads import physical_cores

    threads = torch.get_num_threads()  # a GPU engine made earlier in this process left torch one thread
    torch.set_num_threads(physical_cores())
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setenv("DEEPINFER_SPARSE_CSA_ATTENTION", "1")
            return _long_prompt_run(long_checkpoint, "cpu", 1024)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("mode", ["0", "1"])
def test_long_prompt_logits_match_the_reference_path_at_64k(long_checkpoint, long_cpu_reference, monkeypatch,
                                                            mode):
    """A 65,536-token prompt on the NVIDIA backend in 8,192-token prefill steps (the Triton indexer scores, the
    radix top-k of each prefill row over up to 16,384 CSA entries; ``DEEPINFER_SPARSE_CSA_ATTENTION`` ``0``: the
    dense masked attention, ``1``: the Triton sparse kernel reading each row's listed keys in place), then
    ``LONG_STEPS`` greedy tokens replayed from CUDA graphs at a 64K context (keys + ``torch.topk`` selection),
    against the CPU reference path on the same checkpoint, fp32 on both sides: greedy tokens equal until a near-tie
    of the reference (top-2 gap under ``LONG_TIE_GAP``); the logprobs of the generated tokens and of the prompt's
    last ``LONG_SCORED`` positions within ``LONG_TOL``, the latter's median within ``LONG_TOL_MEDIAN``. fp32 runs
    neither the TileLang attention nor the Triton decode attention (16-bit only).

    Tolerance. The two sides sum in other orders (GEMMs, attention, the indexer's dot products), so the indexer's
    fp32 scores differ in their last bits, and where a row's k-th and (k+1)-th entries score closer than that, the
    sides select different entries (on equal scores the top-k is the reference's bit for bit:
    ``test_kernels_gpu.py``). Such a flip swaps one of the row's 128 + ``LONG_TOPK`` keys for one that scores the
    same, and moves later positions through the states it writes. The test bounds flips rather than avoiding them.
    Measured on the CPU at 64K with this model and these settings, the reference against itself with its indexer
    scores times ``1 + noise`` (Gaussian; the scores only select, so whatever moves comes from flipped selections):
    noise 1e-6 (about the sides' disagreement) moved the last 512 prompt logprobs by at most 3.7e-3 (median 4.8e-6)
    and the generated ones by 4.2e-3; noise 1e-5 by at most 0.040 (median 8.5e-5) and 4.4e-3. ``LONG_TOL`` (0.05)
    covers ten times the expected disagreement; the median keeps the test sharp: a change that moves every row, even
    one more entry read per row (``index_topk`` 257 against 256), moved the median by 4.4e-3, above
    ``LONG_TOL_MEDIAN`` (1e-3). A flip that moves a generated token's logprob by 4.4e-3 moves its top-2 gap by about
    twice that at most: ``LONG_TIE_GAP`` (0.02)."""
    monkeypatch.setenv("DEEPINFER_SPARSE_CSA_ATTENTION", mode)
    want_steps, want_scored, _ = long_cpu_reference
    got_steps, got_scored, replays = _long_prompt_run(long_checkpoint, "nvidia_sm100", 8192)
    assert replays >= LONG_STEPS - 1, "decode steps at 64K should replay CUDA graphs"
    label = f"64K prompt, CSA attention mode {mode}: gpu fp32 vs cpu reference"
    _compare([want_steps], [got_steps], lp_tol=LONG_TOL, tie_gap=LONG_TIE_GAP, label=label, steps=LONG_STEPS)
    diffs = sorted(abs(w - g) for w, g in zip(want_scored, got_scored, strict=True))
    worst, median = diffs[-1], diffs[len(diffs) // 2]
    print(f"[{label}] last {LONG_SCORED} prompt positions: max |logprob diff| {worst:.3g}, median {median:.3g}")
    assert worst < LONG_TOL and median < LONG_TOL_MEDIAN


def test_dummy_weights_on_the_gpu_are_the_preset_checkpoints(tmp_path):
    """``load_format="dummy"`` draws on the GPU the bytes a preset written on the GPU holds (its generator, the
    writer's quantization there): the tiny preset quantized as ``v4-flash-8l64e-fp4`` is."""
    import torch

    from deepinfer_core.bench import presets
    from deepinfer_core.models.deepseek_v4.loader import load_deepseek_v4
    from deepinfer_core.ops.table import OpTable

    folder = presets.write_random_checkpoint(tmp_path / "fp4", presets.get_preset("tiny").config_dict(),
                                             device="cuda", quantize=presets.FLASH_FP4)
    read, drawn = (load_deepseek_v4(folder, OpTable(), dtype=torch.bfloat16, device="cuda", load_format=load_format)
                   for load_format in ("auto", "dummy"))
    assert read.parameters.keys() == drawn.parameters.keys()
    assert all(torch.equal(read.parameters[n].view(torch.uint8), drawn.parameters[n].view(torch.uint8))
               for n in read.parameters)

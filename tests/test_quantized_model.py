"""The engine on quantized checkpoints (fp8 block linears, MXFP4 or fp8 experts) matches HF transformers 5.23 run on
the exactly dequantized weights (fp32, CPU), through the model and through ``LLM``; ops that a backend overrides for
unquantized weights never receive a quantized tensor."""

from __future__ import annotations

import json

import pytest
import torch
from v4_factory import ALL_TYPES, tiny_checkpoint

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.bench.presets import hf_saved_name
from deepinfer_core.checkpoint import write_checkpoint
from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.models.deepseek_v4.loader import load_deepseek_v4
from deepinfer_core.ops.table import OpTable, reference_ops
from deepinfer_core.quant.writer import QuantRecipe, dequantized_tensors, quantize_checkpoint

pytest.importorskip("transformers")

TOL = 1e-4
BLOCK = 8
QUANTIZED_OPS = {"linear_fp8_block", "grouped_linear_fp8_block", "swiglu_mlp_fp8_block", "moe_experts_fp8_block",
                 "moe_experts_mxfp4"}
RECIPES = {  # block 8: partial scale blocks and fused projections split into runs; 32: one block covers wq_a
    "fp4-experts-ue8m0-block8": QuantRecipe("fp4", "fp8", 8),
    "fp8-experts-float32-block32": QuantRecipe("fp8", "fp8", 32),
}


def _hf_on_dequantized(folder, out):
    """HF DeepseekV4ForCausalLM (fp32) on the exact dequantization of the quantized checkpoint in ``folder``."""
    from transformers import DeepseekV4ForCausalLM

    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config"), config.pop("expert_dtype")
    write_checkpoint(out, {hf_saved_name(n): t for n, t in dequantized_tensors(folder)}, config)
    return DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=list(RECIPES))
def quantized(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    tiny_checkpoint(root / "bf16", layer_types=ALL_TYPES * 2, hc_mult=2, moe_intermediate_size=32)
    quantize_checkpoint(root / "bf16", root / "q", RECIPES[request.param])
    return root / "q", _hf_on_dequantized(root / "q", root / "dequantized")


def _hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def _prompts(lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 64, (n,), generator=gen).tolist() for n in lengths]


def test_prefill_batch_then_decode_matches_hf_on_dequantized_weights(quantized):
    folder, hf = quantized
    model = load_deepseek_v4(folder, OpTable(), dtype=torch.float32)
    prompts = _prompts([5, 23, 40])
    tables = [[s * 16 + b for b in range(16)] for s in range(len(prompts))]
    state = model.new_state(num_slots=len(prompts), num_blocks=64, block_size=BLOCK)
    batch = ForwardBatch.build(prompts, [0] * len(prompts), list(range(len(prompts))), tables, logits="all")
    logits = model.forward(batch, state).logits
    offset = 0
    for tokens in prompts:
        torch.testing.assert_close(logits[offset:offset + len(tokens)], _hf_logits(hf, tokens), atol=TOL, rtol=0)
        offset += len(tokens)
    extended = prompts[2] + _prompts([6], seed=9)[0]
    decoded = []
    for pos in range(len(prompts[2]), len(extended)):  # one token per step after the prompt
        step = ForwardBatch.build([[extended[pos]]], [pos], [2], [tables[2]], logits="all")
        decoded.append(model.forward(step, state).logits)
    torch.testing.assert_close(torch.cat(decoded), _hf_logits(hf, extended)[len(prompts[2]):], atol=TOL, rtol=0)


def test_llm_greedy_tokens_and_logprobs_match_hf(quantized):
    folder, hf = quantized
    llm = LLM(str(folder), block_size=8, max_num_seqs=4, max_num_batched_tokens=16)
    prompts = _prompts([7, 19], seed=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    for prompt, output in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                     use_tqdm=False), strict=True):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        tokens = ref.sequences[0, len(prompt):].tolist()
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        ref_logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(ref.logits, tokens)]
        ours = [completion.logprobs[i][t].logprob for i, t in enumerate(tokens)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref_logprobs), atol=1e-4, rtol=0)


def test_unquantized_ops_never_see_a_quantized_tensor(quantized):
    """A backend's ``linear`` / ``moe_experts`` / ... kernels (NVIDIA's) get float weights only: every op but the
    quantized ones (and ``fork``, which passes its arguments on) refuses fp8, e8m0 and packed uint8 tensors."""
    quantized_dtypes = {torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.uint8}
    seen = set()

    def guarded(name, op):
        def call(*args, **kwargs):
            bad = [a.dtype for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)
                   and a.dtype in quantized_dtypes]
            assert not bad, f"op {name} received {bad}"
            return op(*args, **kwargs)
        return call

    def recorded(name, op):
        def call(*args, **kwargs):
            seen.add(name)
            return op(*args, **kwargs)
        return call

    overrides = {name: recorded(name, op) if name in QUANTIZED_OPS else guarded(name, op)
                 for name, op in reference_ops().items() if name != "fork"}
    model = load_deepseek_v4(quantized[0], OpTable(overrides, source="guard"), dtype=torch.float32)
    tokens = _prompts([20])[0]
    state = model.new_state(num_slots=1, num_blocks=16, block_size=BLOCK)
    logits = model.forward(ForwardBatch.build([tokens], [0], [0], [list(range(16))], logits="all"), state).logits
    torch.testing.assert_close(logits, _hf_logits(quantized[1], tokens), atol=TOL, rtol=0)
    experts = "moe_experts_mxfp4" if "fp4" in str(quantized[0].parent) else "moe_experts_fp8_block"
    assert seen == {"linear_fp8_block", "grouped_linear_fp8_block", "swiglu_mlp_fp8_block", experts}

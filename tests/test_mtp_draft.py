"""The MTP draft layer (deepseek_v4/mtp.py) against a hand computation: the MTP formula in plain torch around HF
transformers' own DeepseekV4DecoderLayer (the reference block), on a tiny random checkpoint."""

from __future__ import annotations

import pytest
import torch
from v4_factory import MTP_TARGET_LAYERS, ReferenceMTP, tiny_checkpoint_with_mtp, tiny_hf_model

from deepinfer_core.checkpoint import CheckpointError
from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.models.deepseek_v4.loader import load_deepseek_v4
from deepinfer_core.models.deepseek_v4.mtp import load_mtp_draft
from deepinfer_core.ops.table import OpTable

pytest.importorskip("transformers")

@pytest.fixture(scope="module", params=[True, False], ids=["confidence-head", "no-head"])
def setup(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("mtp")
    reference = ReferenceMTP(seed=5, confidence=request.param)
    tiny_checkpoint_with_mtp(folder, reference)
    target = load_deepseek_v4(folder, OpTable())
    draft = load_mtp_draft(folder, target)
    return reference, target, draft


def _target_hidden(target, tokens):
    """The target's last streams ``[T, hc, D]`` over ``tokens`` (one sequence)."""
    state = target.new_state(1, 8)
    batch = ForwardBatch.build([tokens], [0], [0], [list(range(8))], logits="all")
    last = target.config.num_hidden_layers - 1
    return target.forward(batch, state, capture_layers=[last]).hidden_states[last]


TOKENS = [5, 9, 17, 3, 3, 40, 22, 8, 61, 12, 7, 30, 30, 2, 19, 44, 11]


def test_draft_rows_match_the_hand_computation(setup):
    reference, target, draft = setup
    hidden = _target_hidden(target, TOKENS)  # [T, hc, D]
    n = len(TOKENS) - 1  # draft rows 0 .. n - 1: token t[i + 1] with h[i]
    positions = torch.arange(n)
    state = draft.new_state(2)
    batch = ForwardBatch.build([TOKENS[1:]], [0], [1], [[]], logits="all")
    got = draft.forward(batch, state, hidden[:n])
    x = reference.block_input(hidden[:n], torch.tensor(TOKENS[1:]), positions, target.embed)
    streams, logits, confidence = reference.run(x, positions, target.head)
    torch.testing.assert_close(got.streams, streams, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.logits, logits, atol=1e-4, rtol=1e-5)
    if confidence is None:
        assert got.confidence is None
    else:
        torch.testing.assert_close(got.confidence, confidence, atol=1e-6, rtol=1e-5)


def test_chunked_rows_match_one_pass(setup):
    _, target, draft = setup
    hidden = _target_hidden(target, TOKENS)
    n = len(TOKENS) - 1
    whole = draft.forward(ForwardBatch.build([TOKENS[1:]], [0], [0], [[]], logits="all"), draft.new_state(1),
                          hidden[:n])
    state = draft.new_state(1)
    split = 6
    draft.forward(ForwardBatch.build([TOKENS[1:split + 1]], [0], [0], [[]]), state, hidden[:split])
    rest = draft.forward(ForwardBatch.build([TOKENS[split + 1:]], [split], [0], [[]], logits="all"), state,
                         hidden[split:n])
    torch.testing.assert_close(rest.logits, whole.logits[split:], atol=1e-5, rtol=1e-5)


def test_k_step_drafts_match_the_hand_chain_and_leave_the_ring_as_verified(setup):
    reference, target, draft = setup
    k = 4
    hidden = _target_hidden(target, TOKENS)
    n = len(TOKENS) - 1
    state = draft.new_state(3)
    batch = ForwardBatch.build([TOKENS[1:]], [0], [2], [[]])
    drafts = draft.propose(batch, state, hidden[:n], k)
    assert drafts.token_ids.shape == (1, k) and drafts.logits.shape == (1, k, target.vocab_size)

    # by hand: committed rows, then each speculative row appended (it sees the committed rows and earlier drafts)
    positions = torch.arange(n)
    x = reference.block_input(hidden[:n], torch.tensor(TOKENS[1:]), positions, target.embed)
    streams, logits, confidence = reference.run(x, positions, target.head)
    expected_logits, expected_conf = [logits[-1]], [None if confidence is None else confidence[-1]]
    token = logits[-1].argmax()
    for j in range(1, k):
        pos = torch.tensor([n - 1 + j])
        row = reference.block_input(streams[-1:], token[None], pos, target.embed)
        x = torch.cat([x, row])
        positions = torch.cat([positions, pos])
        streams, logits, confidence = reference.run(x, positions, target.head)
        expected_logits.append(logits[-1])
        expected_conf.append(None if confidence is None else confidence[-1])
        token = logits[-1].argmax()
    expected = torch.stack(expected_logits)
    torch.testing.assert_close(drafts.logits[0], expected, atol=1e-4, rtol=1e-5)
    assert drafts.token_ids[0].tolist() == expected.argmax(-1).tolist()
    if draft.has_confidence_head:
        torch.testing.assert_close(drafts.confidence[0], torch.stack(expected_conf), atol=1e-5, rtol=1e-5)
    else:  # the draft's own probability of its token
        probs = expected.softmax(-1).gather(-1, drafts.token_ids[0][:, None])[:, 0]
        torch.testing.assert_close(drafts.confidence[0], probs, atol=1e-5, rtol=1e-5)

    # the speculative rows left nothing behind: the ring is what folding the verified rows alone leaves
    alone = draft.new_state(3)
    draft.forward(batch, alone, hidden[:n])
    assert torch.equal(state.rings[0][2], alone.rings[0][2])


def test_batch_of_two_sequences_matches_each_alone(setup):
    _, target, draft = setup
    a, b = TOKENS, TOKENS[3:12]
    ha, hb = _target_hidden(target, a), _target_hidden(target, b)
    both = draft.propose(ForwardBatch.build([a[1:], b[1:]], [0, 0], [0, 1], [[], []]), draft.new_state(2),
                         torch.cat([ha[:-1], hb[:-1]]), 3)
    for s, (tokens, hidden) in enumerate(((a, ha), (b, hb))):
        alone = draft.propose(ForwardBatch.build([tokens[1:]], [0], [0], [[]]), draft.new_state(1), hidden[:-1], 3)
        assert both.token_ids[s].tolist() == alone.token_ids[0].tolist()
        torch.testing.assert_close(both.logits[s], alone.logits[0], atol=1e-5, rtol=1e-5)


def test_checkpoint_without_draft_layers_gives_none_and_a_short_one_is_refused(tmp_path):
    plain = tmp_path / "plain"
    tiny_hf_model(plain, seed=1, layer_types=MTP_TARGET_LAYERS)
    target = load_deepseek_v4(plain, OpTable())
    assert load_mtp_draft(plain, target) is None
    short = tmp_path / "short"
    tiny_checkpoint_with_mtp(short, ReferenceMTP(seed=2, confidence=False), num_nextn=2)
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers=2.*mtp.1"):
        load_mtp_draft(short, load_deepseek_v4(short, OpTable()))


def test_fp8_draft_layer_is_held_as_stored_and_runs_as_its_dequantized_weights(tmp_path):
    """A checkpoint's fp8 block-quantized mtp.* matrices (as DeepSeek ships them) load with their scales and run
    through the fp8 ops; the same weights dequantized into a plain checkpoint give the same drafts."""
    import json

    from safetensors.torch import load_file, save_file

    from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config
    from deepinfer_core.models.deepseek_v4.mtp import expected_draft_tensors
    from deepinfer_core.models.deepseek_v4.weights import WEIGHT
    from deepinfer_core.quant import fp8_block
    from deepinfer_core.quant.tensors import scale_name

    reference, block = ReferenceMTP(seed=5, confidence=True), (16, 16)
    plain, quantized = tmp_path / "plain", tmp_path / "fp8"
    for folder in (plain, quantized):
        tiny_checkpoint_with_mtp(folder, reference)
    config = DeepseekV4Config.from_file(plain / "config.json")
    dense, stored = load_file(plain / "model.safetensors"), load_file(quantized / "model.safetensors")
    for name, (_, kind) in expected_draft_tensors(config, 1, True).items():
        if kind == WEIGHT:
            weight, scale = fp8_block.quantize(dense[name], block, ue8m0=True)
            stored[name], stored[scale_name(name)] = weight, scale
            dense[name] = fp8_block.dequantize(weight, scale, block).to(dense[name].dtype)
    save_file(dense, plain / "model.safetensors", metadata={"format": "pt"})
    save_file(stored, quantized / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((quantized / "config.json").read_text())
    raw.update(expert_dtype="fp8", quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(
        block), "scale_fmt": "ue8m0", "activation_scheme": "dynamic"})
    (quantized / "config.json").write_text(json.dumps(raw))

    drafts = {}
    for name, folder in (("plain", plain), ("fp8", quantized)):
        target = load_deepseek_v4(folder, OpTable())
        draft = load_mtp_draft(folder, target)
        hidden = _target_hidden(target, TOKENS)[:-1]
        drafts[name] = draft.propose(ForwardBatch.build([TOKENS[1:]], [0], [0], [[]]), draft.new_state(1), hidden, 3)
        if name == "fp8":
            assert draft.parameters["mtp.0.e_proj.weight"].dtype == torch.float8_e4m3fn
            assert draft.parameters["mtp.0.ffn.experts.1.w2.weight"].dtype == torch.float8_e4m3fn
            assert "mtp.0.attn.wq_a.scale" in draft.parameters
    assert drafts["fp8"].token_ids.tolist() == drafts["plain"].token_ids.tolist()
    torch.testing.assert_close(drafts["fp8"].logits, drafts["plain"].logits, atol=1e-4, rtol=1e-4)


def test_a_second_draft_layer_attends_over_its_own_rows_of_the_round(tmp_path):
    """num_nextn_predict_layers 2 (mtp.1 a copy of mtp.0): step 2 runs layer 1, which holds no verified rows (only
    layer 0 folds them), so its row at p + 1 attends to itself alone, not to its ring's empty rows."""
    import json

    from safetensors.torch import load_file, save_file

    reference = ReferenceMTP(seed=5, confidence=False)
    tiny_checkpoint_with_mtp(tmp_path, reference)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors.update({"mtp.1." + n.removeprefix("mtp.0."): t.clone() for n, t in tensors.items() if n.startswith("mtp.0.")})
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(raw))
    target = load_deepseek_v4(tmp_path, OpTable())
    draft = load_mtp_draft(tmp_path, target)
    assert draft.num_layers == 2
    hidden = _target_hidden(target, TOKENS)
    n = len(TOKENS) - 1
    drafts = draft.propose(ForwardBatch.build([TOKENS[1:]], [0], [0], [[]]), draft.new_state(1), hidden[:n], 2)
    positions = torch.arange(n)
    x = reference.block_input(hidden[:n], torch.tensor(TOKENS[1:]), positions, target.embed)
    streams, logits, _ = reference.run(x, positions, target.head)
    row = reference.block_input(streams[-1:], logits[-1].argmax()[None], torch.tensor([n]), target.embed)
    _, alone, _ = reference.run(row, torch.tensor([n]), target.head)
    torch.testing.assert_close(drafts.logits[0, 1], alone[0], atol=1e-4, rtol=1e-5)

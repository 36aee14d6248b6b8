"""The embedded default model, deepinfer_core/assets/tiny_v4 (made by tools/train_tiny.py).

Fast CPU checks of what ships: the folder's files and size, the config's V4 features, the hash-MoE table, the
tokenizer's exact round trip and chat template, the model card's numbers, and HF transformers loading it and
greedy-generating Python-looking text. (Engine-vs-HF parity on this checkpoint lives with the engine tests.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import deepinfer_core

TINY = Path(deepinfer_core.__file__).resolve().parent / "assets" / "tiny_v4"
EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "MODEL_CARD.md",
}
MAX_BYTES = 15 * 1000 * 1000
PROMPT = "def fibonacci(n):"
CODE = (
    "import os\n\n\n"
    "class Fib:\n"
    '    """Fibonacci numbers, \tcached."""\n\n'
    "    def __init__(self):\n"
    "        self.memo = {0: 0, 1: 1}  # base cases   \n\n"
    "    def __call__(self, n: int) -> int:\n"
    "        if n not in self.memo:\n"
    "\t\tself.memo[n] = self(n - 1) + self(n - 2)\n"
    "        return self.memo[n]\n"
    "print(f'{Fib()(10)!r} → café ✓')\n"
)


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((TINY / "config.json").read_text())


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    with safe_open(str(TINY / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


def test_folder_has_exactly_the_shipped_files_within_budget():
    names = {p.name for p in TINY.iterdir()}
    assert names == EXPECTED_FILES, f"unexpected {names - EXPECTED_FILES}, missing {EXPECTED_FILES - names}"
    assert all((TINY / n).is_file() for n in names)
    size = sum((TINY / n).stat().st_size for n in names)
    assert size <= MAX_BYTES, f"tiny_v4 is {size} bytes, over the {MAX_BYTES} budget"


def test_config_uses_every_v4_feature(config):
    assert config["model_type"] == "deepseek_v4"
    n = config["num_hidden_layers"]
    assert len(config["layer_types"]) == n and len(config["mlp_layer_types"]) == n
    assert set(config["layer_types"]) == {
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    assert config["mlp_layer_types"].count("hash_moe") == 1 and config["mlp_layer_types"][0] == "hash_moe"
    assert config["hc_mult"] == 4
    assert config["head_dim"] >= 64
    assert config["compress_rates"] == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    # The indexer's top-k must cover every visible CSA entry (HF breaks ReLU-score ties non-deterministically).
    assert config["index_topk"] * config["compress_rates"]["compressed_sparse_attention"] >= config[
        "max_position_embeddings"
    ]
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)


def test_weights_parameter_count_and_dtypes(config, tensors):
    target = {name: t for name, t in tensors.items() if not name.startswith("mtp.")}
    n_params = sum(t.numel() for name, t in target.items() if not name.endswith("tid2eid"))
    assert 4_000_000 <= n_params <= 7_000_000, n_params
    dtypes = {t.dtype for t in tensors.values()}
    assert dtypes <= {torch.bfloat16, torch.float32, torch.int64}, dtypes
    embed = next(t for name, t in tensors.items() if name.endswith("embed_tokens.weight") or name == "embed.weight")
    assert embed.shape == (config["vocab_size"], config["hidden_size"])


def test_one_mtp_draft_layer_with_a_confidence_head_ships(config, tensors):
    """tools/train_tiny_mtp.py's layer: DeepSeek's mtp.0.* names (HF ignores them), the block's own MoE."""
    assert config["num_nextn_predict_layers"] == 1
    draft = {name for name in tensors if name.startswith("mtp.")}
    assert {"mtp.0.enorm.weight", "mtp.0.hnorm.weight", "mtp.0.e_proj.weight", "mtp.0.h_proj.weight",
            "mtp.0.norm.weight", "mtp.0.hc_head_fn", "mtp.0.attn.wq_a.weight", "mtp.0.ffn.experts.0.w1.weight",
            "mtp.0.confidence_head.weight", "mtp.0.confidence_head.bias"} <= draft
    assert not any(name.startswith("mtp.1.") for name in draft)


def test_model_card_reports_the_draft_acceptance_length():
    card = (TINY / "MODEL_CARD.md").read_text()
    length = float(re.search(r"mtp \(every draft token\)[^|]*\|[^|]*\|\s*\**([0-9.]+)", card).group(1))
    assert length >= 2.5, length


def test_hash_table_is_a_real_random_table(config, tensors):
    tables = [t for name, t in tensors.items() if name.endswith("gate.tid2eid")]
    assert len(tables) == 1, "exactly one hash-MoE layer carries a tid2eid table"
    table = tables[0]
    assert table.shape == (config["vocab_size"], config["num_experts_per_tok"])
    assert table.any(), "tid2eid is all zeros (HF's placeholder init): every token would go to expert 0"
    assert int(table.min()) >= 0 and int(table.max()) < config["n_routed_experts"]
    sorted_rows = table.sort(dim=-1).values
    assert (sorted_rows[:, 1:] != sorted_rows[:, :-1]).all(), "a token row repeats an expert"
    # every expert is used by a fair share of the vocabulary
    counts = torch.bincount(table.flatten(), minlength=config["n_routed_experts"])
    assert counts.min() > table.numel() / config["n_routed_experts"] / 2


def test_tokenizer_round_trips_code_exactly():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    assert 4096 <= tok.get_vocab_size() <= 8192
    assert tok.token_to_id("<|bos|>") == 0 and tok.token_to_id("<|eos|>") == 1
    for role in ("<|system|>", "<|user|>", "<|assistant|>"):
        assert tok.token_to_id(role) is not None
    ids = tok.encode(CODE).ids
    assert ids[0] == 0, "encoding starts with <|bos|>"
    assert tok.decode(ids, skip_special_tokens=True) == CODE
    assert tok.decode(tok.encode(CODE, add_special_tokens=False).ids) == CODE
    # BPE learned Python: common keywords with their leading space are single tokens
    assert len(tok.encode(" return", add_special_tokens=False).ids) == 1
    assert len(tok.encode("    def", add_special_tokens=False).ids) <= 2


def test_tokenizer_config_and_chat_template_render():
    import jinja2

    cfg = json.loads((TINY / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (cfg["bos_token"], cfg["eos_token"]) == ("<|bos|>", "<|eos|>")
    assert cfg["model_max_length"] == json.loads((TINY / "config.json").read_text())["max_position_embeddings"]
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Fibonacci, please."},
    ]
    text = jinja2.Environment().from_string(cfg["chat_template"]).render(
        messages=messages, add_generation_prompt=True, bos_token=cfg["bos_token"], eos_token=cfg["eos_token"]
    )
    assert text == (
        "<|bos|><|system|>\nYou write Python.<|eos|>\n<|user|>\nFibonacci, please.<|eos|>\n<|assistant|>\n"
    )


def test_generation_config_matches_tokenizer():
    gen = json.loads((TINY / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (0, 1)


def test_model_card_reports_perplexity_far_below_unigram():
    card = (TINY / "MODEL_CARD.md").read_text()
    shipped = float(re.search(r"shipped weights[^|]*\|\s*\**([0-9.]+)", card).group(1))
    unigram = float(re.search(r"unigram baseline[^|]*\|\s*([0-9.]+)", card).group(1))
    assert shipped * 5 < unigram, (shipped, unigram)
    assert "PSF License" in card and "python tools/train_tiny.py" in card


@pytest.fixture
def one_thread():
    """A 5M-parameter model gains nothing from more threads, and on a loaded machine their barriers cost 10x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_hf_transformers_loads_it_and_writes_python(one_thread):
    transformers = pytest.importorskip("transformers")
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(TINY)
    # the hash table survives HF's loading (its _init_weights would zero a missing one)
    assert model.model.layers[0].mlp.gate.tid2eid.any()
    # HF's tokenizer matches the raw tokenizer, BOS included, and its chat template renders
    ids = tok(PROMPT, return_tensors="pt").input_ids
    assert ids[0, 0].item() == 0
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|bos|><|user|>\nhi<|eos|>\n<|assistant|>\n"

    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
    new = out[0, ids.shape[1]:]
    assert new.numel() >= 1
    text = tok.decode(new, skip_special_tokens=True)
    assert any(marker in text for marker in ("return", "(", ":", "=", "\n    ")), repr(text)
    # not a single token repeated over and over
    assert len(set(new.tolist())) >= 3, repr(text)

"""Tiny random DeepSeek-V4 checkpoints written by HF transformers, for parity tests."""

from __future__ import annotations

import torch

ALL_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]


def tiny_hf_config(layer_types=None, hc_mult=2, num_hash_layers=1, index_topk=64, vocab_size=64, **overrides):
    """A few-thousand-parameter V4 config: CSA ratio 4, HCA ratio 8, window 8 (block multiple 8)."""
    from transformers import DeepseekV4Config

    layer_types = layer_types or list(ALL_TYPES)
    kwargs = {
        "vocab_size": vocab_size, "hidden_size": 32, "moe_intermediate_size": 16,
        "num_hidden_layers": len(layer_types), "num_attention_heads": 4, "head_dim": 32, "q_lora_rank": 16,
        "num_experts_per_tok": 2, "n_routed_experts": 4, "o_groups": 2, "o_lora_rank": 8, "index_n_heads": 2,
        "index_head_dim": 16, "index_topk": index_topk, "sliding_window": 8, "layer_types": layer_types,
        "mlp_layer_types": ["hash_moe"] * num_hash_layers + ["moe"] * (len(layer_types) - num_hash_layers),
        "hc_mult": hc_mult, "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "partial_rotary_factor": 0.25, "max_position_embeddings": 4096,
    }
    kwargs.update(overrides)
    return DeepseekV4Config(**kwargs)


def randomize(model, seed: int = 0) -> None:
    """Give every parameter and buffer non-trivial values (HF zero-inits sinks, biases, tid2eid)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                experts, k = model.config.n_routed_experts, tensor.shape[1]
                rows = [torch.randperm(experts, generator=gen)[:k] for _ in range(tensor.shape[0])]
                tensor.copy_(torch.stack(rows))
            elif tensor.dtype.is_floating_point:
                noise = torch.randn(tensor.shape, generator=gen)
                if "norm" in name:
                    tensor.copy_(1 + 0.1 * noise)
                else:
                    tensor.copy_(noise * (0.5 if tensor.dim() < 2 else 0.2))


def tiny_hf_model(folder, seed: int = 0, **config_kwargs):
    """Build, randomize and ``save_pretrained`` a tiny HF DeepseekV4ForCausalLM; returns the model."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(tiny_hf_config(**config_kwargs)).eval()
    randomize(model, seed)
    model.save_pretrained(folder)
    return model


def write_tiny_tokenizer(folder, vocab_size: int = 64) -> None:
    """A word-level tokenizer over ``w0 .. w{n}`` plus <bos>/<eos>, with a chat template."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<bos>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<bos>", "<eos>"])
    folder = Path(folder)
    tok.save(str(folder / "tokenizer.json"))
    template = "{% for m in messages %}w2 {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": template, "add_bos_token": False}))


def tiny_checkpoint(folder, seed: int = 0, **config_kwargs):
    """HF-written tiny V4 checkpoint plus a tokenizer: a folder ``LLM`` can load. Returns the HF model."""
    hf = tiny_hf_model(folder, seed=seed, **config_kwargs)
    write_tiny_tokenizer(folder, hf.config.vocab_size)
    return hf

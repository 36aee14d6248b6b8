"""Tiny random DeepSeek-V4 checkpoints written by HF transformers, for parity tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ALL_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
# Overrides of the tiny bench preset (``PRESETS["tiny"].config_dict(SMALL_PRESET)``) for quantized checkpoints: widths
# of 32-input MXFP4 groups, two layers (sliding and CSA, a hash-routed and a routed MoE), four experts.
SMALL_PRESET = {"vocab_size": 64, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 2,
                "layer_types": ["sliding_attention", "compressed_sparse_attention"],
                "mlp_layer_types": ["hash_moe", "moe"], "num_attention_heads": 2, "head_dim": 32, "q_lora_rank": 32,
                "o_groups": 2, "o_lora_rank": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "index_n_heads": 2,
                "index_head_dim": 16, "index_topk": 64, "hc_mult": 2, "sliding_window": 8,
                "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                "partial_rotary_factor": 0.25, "max_position_embeddings": 256}


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


# ------------------------------------------------------------------------------------- MTP draft layers
MTP_TARGET_LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
MTP_WINDOW = 8  # tiny_hf_config's sliding window: sequences here are longer, so the draft's ring wraps


class ReferenceMTP:
    """The draft layer by hand: plain torch for the MTP parts, HF's decoder layer for the block."""

    def __init__(self, seed: int, confidence: bool):
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

        config = tiny_hf_config(layer_types=["sliding_attention"], num_hash_layers=0)
        self.config = config
        torch.manual_seed(seed)
        self.block = hf.DeepseekV4DecoderLayer(config, 0).eval()
        self.hc_head = hf.DeepseekV4HyperHead(config)
        self.rope = hf.DeepseekV4RotaryEmbedding(config)
        randomize(self.block, seed)
        randomize(self.hc_head, seed + 1)
        gen = torch.Generator().manual_seed(seed + 2)
        D = config.hidden_size
        self.tensors = {
            "enorm.weight": 1 + 0.1 * torch.randn(D, generator=gen),
            "hnorm.weight": 1 + 0.1 * torch.randn(D, generator=gen),
            "norm.weight": 1 + 0.1 * torch.randn(D, generator=gen),
            "e_proj.weight": 0.2 * torch.randn(D, D, generator=gen),
            "h_proj.weight": 0.2 * torch.randn(D, D, generator=gen),
            "hc_head_fn": self.hc_head.hc_fn.detach(),
            "hc_head_base": self.hc_head.hc_base.detach(),
            "hc_head_scale": self.hc_head.hc_scale.detach(),
        }
        if confidence:
            self.tensors["confidence_head.weight"] = 0.3 * torch.randn(1, D, generator=gen)
            self.tensors["confidence_head.bias"] = torch.tensor([0.2])

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        from deepinfer_core.models.deepseek_v4.weights import hf_layer_tensors

        out = {f"mtp.0.{name}": t.clone() for name, t in self.tensors.items()}
        out.update((name, t.detach().clone()) for name, t in hf_layer_tensors(self.block.state_dict(), "mtp.0",
                                                                                self.config))
        return out

    def _rms(self, x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps))

    def block_input(self, hidden, next_tokens, positions, embed):
        """``[T, hc, D]``: h_proj(hnorm(h)) + e_proj(enorm(embed(t[i + 1]))), the embedding zeroed at position 0."""
        e = embed[next_tokens] * (positions != 0).unsqueeze(-1)
        e = F.linear(self._rms(e, self.tensors["enorm.weight"]), self.tensors["e_proj.weight"])
        h = F.linear(self._rms(hidden, self.tensors["hnorm.weight"]), self.tensors["h_proj.weight"])
        return h + e.unsqueeze(1)

    @torch.no_grad()
    def run(self, x, positions, head):
        """The block over rows ``x [T, hc, D]`` at ``positions`` (causal, window 8): streams, logits, confidence."""
        T = x.shape[0]
        i, j = positions[:, None], positions[None, :]
        mask = torch.where((j <= i) & (i - j < MTP_WINDOW), 0.0, float("-inf"))[None, None]  # [1, 1, T, T]
        pos = positions[None]
        emb = {t: self.rope(x[None, :, 0], position_ids=pos, layer_type=t) for t in ("main", "compress")}
        streams = self.block(x[None], position_embeddings=emb, position_ids=pos, attention_mask=mask)[0]
        final = self._rms(self.hc_head(streams[None])[0], self.tensors["norm.weight"])  # [T, D]
        confidence = None
        if "confidence_head.weight" in self.tensors:
            w, b = self.tensors["confidence_head.weight"], self.tensors["confidence_head.bias"]
            confidence = torch.sigmoid(final @ w[0] + b[0])
        assert streams.shape[0] == T
        return streams, F.linear(final, head), confidence


def tiny_checkpoint_with_mtp(folder, reference: ReferenceMTP, num_nextn: int = 1, seed: int = 3):
    """A tiny checkpoint of ``MTP_TARGET_LAYERS`` plus ``reference``'s ``mtp.0.*`` tensors (config.json declaring
    ``num_nextn`` draft layers) and a tokenizer."""
    import json

    from safetensors.torch import load_file, save_file

    tiny_hf_model(folder, seed=seed, layer_types=MTP_TARGET_LAYERS)
    write_tiny_tokenizer(folder)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors.update(reference.checkpoint_tensors())
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = num_nextn
    (folder / "config.json").write_text(json.dumps(config))


def _on_schedule(llm, note) -> None:
    """Call ``note(output)`` with every ``SchedulerOutput`` ``llm``'s engine plans from now on."""
    schedule = llm.engine.scheduler.schedule

    def recorded():
        output = schedule()
        note(output)
        return output

    llm.engine.scheduler.schedule = recorded


def record_prompt_chunks(llm) -> list[tuple[int, int]]:
    """A list that fills with ``(start, tokens)`` of every prompt chunk (more than one token) ``llm``'s engine plans
    from now on."""
    chunks: list[tuple[int, int]] = []
    _on_schedule(llm, lambda output: chunks.extend((c.start, c.num_tokens) for c in output.chunks if c.num_tokens > 1))
    return chunks


def record_steps(llm) -> list[list[tuple[str, int, int]]]:
    """A list that fills with every step's chunks as ``(request id, start, tokens)``, as ``llm``'s engine plans them
    from now on."""
    steps: list[list[tuple[str, int, int]]] = []
    _on_schedule(llm, lambda output: steps.append([(c.request.request_id, c.start, c.num_tokens)
                                                   for c in output.chunks]))
    return steps

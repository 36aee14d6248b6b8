#!/usr/bin/env python
"""Train the tiny DeepSeek-V4 that ships inside deepinfer_core (issue 5).

Everything here is deterministic and offline:

* corpus: the Python standard library's own ``*.py`` source (``sysconfig.get_paths()["stdlib"]``), which
  every machine with Python has. Files are sorted; tests, site-packages, codec tables and the pydoc topic
  dump are left out. The split is by file: a file is held out when ``crc32(relative path) % 100 < 2``
  (about 2% of the files), so the split does not depend on which other files exist.
* tokenizer: byte-level BPE trained with ``tokenizers`` on the train split (special tokens first, so
  ``<|bos|>`` is id 0 and ``<|eos|>`` is id 1, as in DeepSeek-V4's config defaults).
* model: ``transformers.DeepseekV4ForCausalLM`` (HF transformers 5.23) with all three attention layer types,
  one hash-MoE layer (its ``tid2eid`` table filled with a seeded random table of distinct experts) and
  hc_mult 4; AdamW with linear warmup and cosine decay; a fixed number of steps over a fixed, seeded
  data order.
* evaluation: token-level perplexity on a fixed number of held-out tokens, for the shipped (bf16-stored)
  weights and for a unigram baseline (train-split token frequencies, add-one smoothing) on the same tokens.

Usage::

    python tools/train_tiny.py                      # full run, writes deepinfer_core/assets/tiny_v4/
    python tools/train_tiny.py --steps 20 --out /tmp/probe --no-eval   # throughput probe

The full run takes about 25 minutes on 2 CPU cores (torch.set_num_threads(2)). Bit-exact reproduction
needs the same Python standard library (the card records the version), torch build and thread count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import sys
import sysconfig
import tempfile
import time
import zlib
from collections import Counter
from pathlib import Path

# The 2 cores are usually shared with other work: with OpenMP's default spin-waiting, a descheduled thread stalls
# its partner at every barrier (4x slower when loaded). Passive waiting does not change any result.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "deepinfer_core" / "assets" / "tiny_v4"

SEED = 1234
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
BOS, EOS, PAD = SPECIAL_TOKENS[0], SPECIAL_TOKENS[1], SPECIAL_TOKENS[2]
HELDOUT_PERCENT = 2
SEQ_LEN = 512
BATCH_SIZE = 4
STEPS = 640
WARMUP_STEPS = 40
PEAK_LR = 3e-3
MIN_LR_RATIO = 0.1
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
LOG_EVERY = 20
EVAL_TOKENS = 64 * SEQ_LEN  # held-out tokens for the final perplexity (64 windows of SEQ_LEN)
MID_EVAL_WINDOWS = 16  # cheaper held-out check at 25/50/75% of training
MAX_POSITIONS = 1024

# Excluded corpus parts: test suites (huge, unusual code), third-party packages, generated tables/dumps.
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "pydoc_data",
                 "encodings"}
EXCLUDED_PREFIXES = ("config-", "_sysconfigdata")

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def model_config_kwargs(vocab_size: int) -> dict:
    """The tiny V4's hyper-parameters (HF ``DeepseekV4Config`` field names)."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "layer_types": [
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "sliding_window": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "partial_rotary_factor": 0.25,  # 16 of the 64 channels carry RoPE
        "q_lora_rank": 128,
        "o_groups": 2,
        "o_lora_rank": 128,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 128,
        "index_n_heads": 4,
        "index_head_dim": 32,
        # >= max_position_embeddings / compress_rate(CSA): the indexer's top-k never truncates, so HF's
        # non-deterministic tie-break among ReLU-zero scores can never change the result.
        "index_topk": MAX_POSITIONS // 4,
        "max_position_embeddings": MAX_POSITIONS,
        "hc_mult": 4,
        "num_nextn_predict_layers": 0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "tie_word_embeddings": False,
    }


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------------- corpus
def corpus_files(stdlib: Path) -> list[str]:
    files = []
    for path in stdlib.rglob("*.py"):
        rel = path.relative_to(stdlib)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if rel.parts[0].startswith(EXCLUDED_PREFIXES) or rel.name.startswith(EXCLUDED_PREFIXES):
            continue
        files.append(rel.as_posix())
    return sorted(files)


def read_texts(stdlib: Path, rels: list[str]) -> tuple[list[str], list[str]]:
    kept, texts = [], []
    for rel in rels:
        try:
            text = (stdlib / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            kept.append(rel)
            texts.append(text)
    return kept, texts


def is_heldout(rel: str) -> bool:
    return zlib.crc32(rel.encode("utf-8")) % 100 < HELDOUT_PERCENT


# ------------------------------------------------------------------------------------------ tokenizer
def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    assert (bos_id, eos_id) == (0, 1), (bos_id, eos_id)
    # Encoding adds <|bos|> (as every training document starts with it); decoding round-trips bytes exactly.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
        "chat_template": CHAT_TEMPLATE,
    }


# ----------------------------------------------------------------------------------------------- model
def build_model(vocab_size: int):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = DeepseekV4Config(**model_config_kwargs(vocab_size))
    torch.manual_seed(SEED)
    model = DeepseekV4ForCausalLM(config)
    # HF initialises the hash router's tid2eid buffer to zeros (every token -> expert 0). Give it a seeded
    # random table with distinct experts in each row, as a real checkpoint has.
    gen = torch.Generator().manual_seed(SEED + 1)
    n_hash = 0
    for layer_idx, mlp_type in enumerate(config.mlp_layer_types):
        if mlp_type != "hash_moe":
            continue
        gate = model.model.layers[layer_idx].mlp.gate
        table = torch.rand(vocab_size, config.n_routed_experts, generator=gen).argsort(dim=-1)
        gate.tid2eid.copy_(table[:, : config.num_experts_per_tok].to(gate.tid2eid.dtype))
        n_hash += 1
    assert n_hash == 1
    return model


def lr_at(step: int, total: int) -> float:
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, total - WARMUP_STEPS)
    return PEAK_LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model):
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 and "embed_tokens" not in name else no_decay).append(param)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=PEAK_LR, betas=(0.9, 0.95), eps=1e-8,
    )


@torch.no_grad()
def heldout_nll(model, windows: torch.Tensor) -> tuple[float, int]:
    """Mean next-token NLL (nats) over all predicted positions of ``windows`` [N, T]; and the count."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], 4):
        batch = windows[i : i + 4]
        logits = model(input_ids=batch, use_cache=False).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        nll = -logp.gather(-1, batch[:, 1:, None]).squeeze(-1)
        total += nll.sum().item()
        count += nll.numel()
    model.train(was_training)
    return total / count, count


def unigram_nll(train_counts: Counter, n_train: int, vocab_size: int, windows: torch.Tensor) -> float:
    """Add-one-smoothed unigram NLL (nats) from train-split frequencies, on the same targets as heldout_nll."""
    targets = windows[:, 1:].reshape(-1).tolist()
    denom = n_train + vocab_size
    return sum(-math.log((train_counts.get(t, 0) + 1) / denom) for t in targets) / len(targets)


def to_shipping_dtype(model) -> None:
    """bf16 storage for the big matrices; fp32 for the modules HF itself keeps in fp32 (norms, mHC, sinks, ...)."""
    keep = set(model._keep_in_fp32_modules_strict or [])
    for name, param in model.named_parameters():
        if not any(part in keep for part in name.split(".")):
            param.data = param.data.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16


# ------------------------------------------------------------------------------------------------ main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (replaced)")
    ap.add_argument("--steps", type=int, default=STEPS, help="optimizer steps (default: the shipped run's)")
    ap.add_argument("--no-eval", action="store_true", help="skip evaluation and the model card (probes)")
    args = ap.parse_args()

    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    random.seed(SEED)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    t_start = time.time()

    import transformers
    from transformers import GenerationConfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rels, texts = read_texts(stdlib, corpus_files(stdlib))
    train_idx = [i for i, r in enumerate(rels) if not is_heldout(r)]
    held_idx = [i for i, r in enumerate(rels) if is_heldout(r)]
    train_bytes = sum(len(texts[i].encode()) for i in train_idx)
    held_bytes = sum(len(texts[i].encode()) for i in held_idx)
    log(f"corpus: {stdlib} -> {len(rels)} files; train {len(train_idx)} files / {train_bytes/1e6:.2f} MB, "
        f"held-out {len(held_idx)} files / {held_bytes/1e6:.2f} MB")

    # ---- tokenizer
    t0 = time.time()
    tok = train_tokenizer([texts[i] for i in train_idx])
    vocab_size = tok.get_vocab_size()
    log(f"tokenizer: byte-level BPE, vocab {vocab_size}, trained in {time.time()-t0:.1f}s")

    # ---- token streams
    encode = lambda idx: [e.ids for e in tok.encode_batch([texts[i] for i in idx], add_special_tokens=False)]
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    train_docs = encode(train_idx)
    train_counts: Counter = Counter()
    for ids in train_docs:
        train_counts.update(ids)
    n_train_tokens = sum(len(d) for d in train_docs)
    order = list(range(len(train_docs)))
    random.Random(SEED).shuffle(order)
    stream = []
    for i in order:
        stream.append(bos_id)
        stream.extend(train_docs[i])
        stream.append(eos_id)
    n_windows = len(stream) // SEQ_LEN
    windows = torch.tensor(stream[: n_windows * SEQ_LEN], dtype=torch.long).view(n_windows, SEQ_LEN)
    perm = torch.randperm(n_windows, generator=torch.Generator().manual_seed(SEED + 2))
    needed = args.steps * BATCH_SIZE
    if needed > n_windows:  # more than one epoch: repeat the permutation (never the case for the shipped run)
        perm = perm.repeat(math.ceil(needed / n_windows))
    train_windows = windows[perm[:needed]]
    held_stream = []
    for ids in encode(held_idx):  # held-out files in sorted order
        held_stream += [bos_id] + ids + [eos_id]
    n_eval = EVAL_TOKENS // SEQ_LEN
    assert len(held_stream) >= EVAL_TOKENS, "held-out split too small"
    eval_windows = torch.tensor(held_stream[:EVAL_TOKENS], dtype=torch.long).view(n_eval, SEQ_LEN)
    log(f"tokens: train split {n_train_tokens} ({train_bytes/n_train_tokens:.2f} bytes/token), "
        f"held-out {len(held_stream)}; {n_windows} train windows of {SEQ_LEN}; "
        f"run uses {needed} windows = {needed*SEQ_LEN} tokens")

    # ---- model
    model = build_model(vocab_size)
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    log(f"model: DeepseekV4ForCausalLM, {n_params/1e6:.3f}M parameters ({(n_params-n_embed)/1e6:.3f}M "
        f"without embeddings/head)")
    model.train()
    opt = make_optimizer(model)

    curve = []  # (step, mean train loss over the last LOG_EVERY steps, lr)
    mid_evals = []  # (step, held-out loss on MID_EVAL_WINDOWS windows)
    eval_points = {args.steps // 4, args.steps // 2, 3 * args.steps // 4}
    running, running_n = 0.0, 0
    t_train = time.time()
    for step in range(args.steps):
        lr = lr_at(step, args.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = train_windows[step * BATCH_SIZE : (step + 1) * BATCH_SIZE]
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        running += loss.item()
        running_n += 1
        done = step + 1
        if done % LOG_EVERY == 0 or done == args.steps or done == 1:
            elapsed = time.time() - t_train
            mean = running / running_n
            curve.append((done, mean, lr))
            running, running_n = 0.0, 0
            log(f"step {done}/{args.steps} loss {mean:.4f} lr {lr:.2e} "
                f"{done*BATCH_SIZE*SEQ_LEN/elapsed:.0f} tok/s elapsed {elapsed:.0f}s")
        if done in eval_points and not args.no_eval:
            nll, _ = heldout_nll(model, eval_windows[:MID_EVAL_WINDOWS])
            mid_evals.append((done, nll))
            log(f"  held-out loss ({MID_EVAL_WINDOWS} windows) {nll:.4f} ppl {math.exp(nll):.2f}")
    train_time = time.time() - t_train
    tokens_seen = args.steps * BATCH_SIZE * SEQ_LEN
    log(f"trained {args.steps} steps, {tokens_seen} tokens in {train_time:.0f}s "
        f"({tokens_seen/train_time:.0f} tok/s)")

    fp32_nll = None
    if not args.no_eval:
        fp32_nll, _ = heldout_nll(model, eval_windows)
        log(f"held-out ppl (fp32 weights) {math.exp(fp32_nll):.3f}")

    # ---- save (into a temp folder, then replace the output folder whole)
    model.eval()
    to_shipping_dtype(model)
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=tok.token_to_id(PAD),
        do_sample=True, temperature=0.7, top_p=0.95, top_k=50, max_new_tokens=128,
    )
    tmp = Path(tempfile.mkdtemp(prefix="tiny_v4_"))
    model.save_pretrained(tmp)
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")

    # ---- evaluate what ships: reload from disk in fp32
    from transformers import AutoTokenizer, DeepseekV4ForCausalLM

    shipped = DeepseekV4ForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    shipped.eval()
    tid2eid = shipped.model.layers[0].mlp.gate.tid2eid
    assert torch.equal(tid2eid, model.model.layers[0].mlp.gate.tid2eid), "tid2eid did not survive the save"
    result = {
        "steps": args.steps, "tokens_seen": tokens_seen, "train_seconds": round(train_time, 1),
        "parameters": n_params, "vocab_size": vocab_size,
    }
    sample = ""
    if not args.no_eval:
        nll, n_targets = heldout_nll(shipped, eval_windows)
        uni = unigram_nll(train_counts, n_train_tokens, vocab_size, eval_windows)
        hf_tok = AutoTokenizer.from_pretrained(tmp)
        prompt = "def fibonacci(n):"
        ids = hf_tok(prompt, return_tensors="pt").input_ids
        out = shipped.generate(ids, max_new_tokens=48, do_sample=False)
        sample = hf_tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False)
        result.update(heldout_ppl=math.exp(nll), heldout_ppl_fp32=math.exp(fp32_nll), unigram_ppl=math.exp(uni),
                      heldout_targets=n_targets)
        log(f"held-out ppl (shipped bf16 weights) {math.exp(nll):.3f} vs unigram {math.exp(uni):.3f} "
            f"on {n_targets} tokens")
        log(f"greedy: {prompt!r} -> {sample!r}")
        write_model_card(tmp, result=result, curve=curve, mid_evals=mid_evals, sample=(prompt, sample),
                         corpus=(stdlib, len(train_idx), len(held_idx), train_bytes, held_bytes, n_train_tokens,
                                 len(held_stream)),
                         versions=(platform.python_version(), torch.__version__, transformers.__version__),
                         total_seconds=time.time() - t_start, config=shipped.config)

    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    for f in sorted(tmp.iterdir()):
        shutil.move(str(f), args.out / f.name)
        os.chmod(args.out / f.name, 0o644)
    shutil.rmtree(tmp)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    log(f"wrote {args.out} ({size/1e6:.2f} MB): {sorted(f.name for f in args.out.iterdir())}")
    print(json.dumps(result, indent=2), flush=True)
    return 0


def write_model_card(folder: Path, *, result, curve, mid_evals, sample, corpus, versions, total_seconds,
                     config) -> None:
    _stdlib, n_train_files, n_held_files, train_bytes, held_bytes, n_train_tokens, n_held_tokens = corpus
    py, torch_v, tf_v = versions
    prompt, completion = sample
    lines = [f"| {s} | {loss:.3f} | {lr:.2e} |" for s, loss, lr in curve
             if s == 1 or s % (LOG_EVERY * 4) == 0 or s == result["steps"]]
    mids = "\n".join(f"| {s} | {nll:.3f} | {math.exp(nll):.2f} |" for s, nll in mid_evals)
    lt = config.layer_types
    card = f"""# tiny_v4: a tiny DeepSeek-V4 trained on the Python standard library

The default model of DeepInfer: small enough to ship inside the package ({result['parameters']/1e6:.2f}M parameters),
trained on CPU in about {total_seconds/60:.0f} minutes by `tools/train_tiny.py`, so that `deepinfer generate` does real
work on any machine with no GPU and no network. It writes Python-looking code; it is not a useful assistant.

## Reproduce

```
python tools/train_tiny.py        # writes deepinfer_core/assets/tiny_v4/
```

Deterministic: seed {SEED} (torch, random, the data order and the hash table), a fixed step count ({result['steps']}),
`torch.set_num_threads(2)`. Bit-exact reproduction needs the same inputs and builds as this run:
Python {py} standard library, torch {torch_v}, transformers {tf_v}, 2 threads.

## Data

The `*.py` files of the Python {py} standard library (`sysconfig.get_paths()["stdlib"]`), sorted, leaving out
test suites (`test/`, `tests/`, `idle_test/`), `site-packages/`, `encodings/` (codec tables), `pydoc_data/` and
generated `_sysconfigdata*` / `config-*`. Split by file: a file is held out when
`crc32(relative path) % 100 < {HELDOUT_PERCENT}`.

| split | files | bytes | tokens |
|---|---|---|---|
| train | {n_train_files} | {train_bytes:,} | {n_train_tokens:,} |
| held-out | {n_held_files} | {held_bytes:,} | {n_held_tokens:,} (with BOS/EOS) |

Each file becomes `<|bos|> text <|eos|>`; train files are concatenated in a seeded shuffled order, cut into
windows of {SEQ_LEN} tokens, and the windows shuffled (seeded). The run reads {result['tokens_seen']:,} tokens
(each at most once).

## Tokenizer

Byte-level BPE (`tokenizers`, ByteLevel pre-tokenizer and decoder: decoding round-trips any text exactly,
whitespace included), vocab {result['vocab_size']}, trained on the train split. Special tokens:
`<|bos|>` = 0, `<|eos|>` = 1, `<|pad|>` = 2, `<|system|>` = 3, `<|user|>` = 4, `<|assistant|>` = 5.
Encoding prepends `<|bos|>` (a TemplateProcessing post-processor). tokenizer_config.json carries a simple chat
template with the role tokens; the model never saw chat data, so chat output is code-like.

## Architecture

`DeepseekV4ForCausalLM` (HF transformers {tf_v}), {result['parameters']:,} parameters:
hidden {config.hidden_size}, {config.num_hidden_layers} layers with layer_types {lt}, mlp_layer_types
{config.mlp_layer_types} ({config.n_routed_experts} routed experts, top-{config.num_experts_per_tok},
1 shared, width {config.moe_intermediate_size}), {config.num_attention_heads} heads x head_dim {config.head_dim}
(shared-KV MQA, partial RoPE on {int(config.head_dim * config.partial_rotary_factor)} channels), q_lora_rank
{config.q_lora_rank}, o_groups {config.o_groups} x o_lora_rank {config.o_lora_rank}, hc_mult {config.hc_mult}
(Sinkhorn {config.hc_sinkhorn_iters} iterations), sliding_window {config.sliding_window}, compress_rates
{config.compress_rates}, lightning indexer {config.index_n_heads} heads x {config.index_head_dim},
index_topk {config.index_topk}, max_position_embeddings {config.max_position_embeddings}, vocab {config.vocab_size}.

- **index_topk = max_position_embeddings / 4.** A CSA layer sees at most max_position_embeddings / 4 compressed
  entries, so the indexer's top-k never drops one. HF breaks ties among ReLU-scored indexer entries (exact zeros)
  non-deterministically, so with a smaller index_topk its outputs for a position could change with sequence
  length; with this setting HF full forward, prefix forward and cached decode agree, which the engine's parity
  test relies on. (It also means the indexer selects everything and receives no gradient: its weights are
  the seeded random initialisation.)
- **Hash MoE.** HF initialises `tid2eid` to zeros (every token to expert 0). Layer 0's table here is a seeded
  random table with {config.num_experts_per_tok} distinct experts per token, set before training and saved
  in model.safetensors.
- **Storage.** Matrices are stored in bfloat16 to stay under the 15 MB budget; the modules HF keeps in fp32
  (norms, mHC, sinks, position biases, hc_head) are stored in fp32; `tid2eid` is int64.
  Weight names are what transformers `save_pretrained` writes (DeepSeek's names with a `model.` prefix).
- No MTP layer (num_nextn_predict_layers 0).

## Training

AdamW (betas 0.9/0.95, weight decay {WEIGHT_DECAY} on matrices), peak lr {PEAK_LR}, {WARMUP_STEPS} warmup steps then
cosine decay to {MIN_LR_RATIO:g}x, gradient clip {GRAD_CLIP}, batch {BATCH_SIZE} x {SEQ_LEN} tokens,
{result['steps']} steps = {result['tokens_seen']:,} tokens, {result['train_seconds']/60:.1f} minutes of training
({result['tokens_seen']/result['train_seconds']:.0f} tokens/s on 2 CPU cores; {total_seconds/60:.1f} minutes
for the whole script), fp32. Wall time depends on the machine's load: on 2 idle cores HF trains this model at
about 1,000 tokens/s (about 22 minutes for these steps); with other jobs sharing the cores it is slower, the
result is not.

Train loss (mean over the preceding {LOG_EVERY} steps):

| step | train loss | lr |
|---|---|---|
{chr(10).join(lines)}

Held-out loss during training ({MID_EVAL_WINDOWS} windows):

| step | held-out loss | ppl |
|---|---|---|
{mids}

## Evaluation

Token-level perplexity on the first {EVAL_TOKENS:,} held-out tokens ({EVAL_TOKENS // SEQ_LEN} windows of {SEQ_LEN};
{result['heldout_targets']:,} predicted tokens):

| model | held-out perplexity |
|---|---|
| tiny_v4, shipped weights (bf16 storage, run in fp32) | **{result['heldout_ppl']:.2f}** |
| tiny_v4, fp32 weights before the bf16 cast | {result['heldout_ppl_fp32']:.2f} |
| unigram baseline (train-split frequencies, add-one smoothing) | {result['unigram_ppl']:.2f} |

Greedy completion of `{prompt}` (48 new tokens, HF `generate`, fp32):

```
{prompt}{completion}
```

## License

The training data is the Python standard library source, under the PSF License Agreement (Python Software
Foundation License Version 2). The weights and tokenizer are a derivative trained on it; keep the PSF License
notice with them. The training script is part of DeepInfer (Apache-2.0).
"""
    (folder / "MODEL_CARD.md").write_text(card)


if __name__ == "__main__":
    sys.exit(main())

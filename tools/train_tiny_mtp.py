#!/usr/bin/env python
"""Train the tiny DeepSeek-V4's MTP draft layer and its confidence head (issue 33), into the shipped checkpoint.

The target (``deepinfer_core/assets/tiny_v4``, trained by ``tools/train_tiny.py``) stays frozen and bit-identical:
its tensors are copied into the new ``model.safetensors`` unchanged (checked by hash) beside the new ``mtp.0.*``
tensors, and config.json gains ``num_nextn_predict_layers: 1``.

1. MTP layer (``deepinfer_core/models/deepseek_v4/mtp.py`` is the formula; here the same in HF transformers'
   modules so it trains): draft row ``i`` reads the target's last streams at ``i`` and the embedding of
   ``t[i + 1]``; it learns the target's own next-next distribution (soft cross-entropy against the target's softmax
   at ``i + 1``: greedy verification accepts the target's argmax, not the text's token). A second, chained pass
   trains the layer on its own streams (row ``i`` of pass 2 reads pass 1's streams at ``i - 1`` and the target's
   argmax token), as drafting ``k > 1`` tokens runs it. Same corpus and windows as ``train_tiny.py`` (its train
   split), its block initialised from the target's last layer, its hc_head / norm from the target's.
2. Confidence head: drafting runs the trained layer through the engine (``MTPDraft.propose``, k = 5) on the
   target's greedy continuations of train-split prompts; every draft position up to the first rejection is one
   sample (its draft hidden state; 1 when the drafted token equals the target's greedy token). A logistic
   regression ``sigmoid(w . hidden + b)`` fits them: the acceptance probability of a position given that the
   ones before it were accepted, which is what DSpark's gain (the product along a prefix) needs.
3. Measure on held-out code (the held-out files of ``train_tiny.py``'s split as prompts, the target's greedy
   continuations): acceptance length ``1 + accepted / drafts`` at k = 5 with greedy verification, exactly as the
   engine drafts and verifies (the draft's state holds verified rows only).

Usage (the shipped layer: the first two commands, about 37 minutes on 2 shared cores)::

    python tools/train_tiny_mtp.py --out /tmp/stage1        # 160 steps from the target's last layer
    python tools/train_tiny_mtp.py --resume /tmp/stage1 --start-step 160 --steps 100 --peak-lr 1e-3
                                                            # 100 more; writes deepinfer_core/assets/tiny_v4/
    python tools/train_tiny_mtp.py --measure-only           # acceptance length of the shipped draft layer
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_tiny as base  # the corpus, split and windows of the tiny model

ASSET = base.DEFAULT_OUT
SEED = 4321
SEQ_LEN = 512
BATCH_SIZE = 4
STEPS = 160
WARMUP_STEPS = 10
PEAK_LR = 2e-3
CHAIN_WEIGHT = 0.5  # the chained (second) pass's share of the loss
K = 5
PROMPT_LEN = 96
GEN_LEN = 128
HELDOUT_PROMPTS = 16
CONFIDENCE_PROMPTS = 48
LOG_EVERY = 10
VERIFY_FRACTIONS = (0.5, 0.6, 0.7, 0.8, 0.9)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------ data
def token_splits():
    """(train windows [N, SEQ_LEN] in a seeded order, train documents, held-out documents) as token ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rels, texts = base.read_texts(stdlib, base.corpus_files(stdlib))
    bos, eos = 0, 1
    docs = {r: e.ids for r, e in zip(rels, tok.encode_batch(texts, add_special_tokens=False), strict=True)}
    train = [[bos, *docs[r], eos] for r in rels if not base.is_heldout(r)]
    held = [[bos, *docs[r], eos] for r in rels if base.is_heldout(r)]
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(SEED)).tolist()
    stream = [t for i in order for t in train[i]]
    n = len(stream) // SEQ_LEN
    windows = torch.tensor(stream[: n * SEQ_LEN]).view(n, SEQ_LEN)
    windows = windows[torch.randperm(n, generator=torch.Generator().manual_seed(SEED + 1))]
    return windows, train, held


def prompts(docs: list[list[int]], count: int, seed: int) -> torch.Tensor:
    """``[count, PROMPT_LEN]``: one prompt per document (documents long enough), from a seeded offset."""
    gen = torch.Generator().manual_seed(seed)
    long = [d for d in docs if len(d) > PROMPT_LEN + 1]
    picked = torch.randperm(len(long), generator=gen)[:count].tolist()
    rows = []
    for i in picked:
        doc = long[i]
        start = int(torch.randint(0, len(doc) - PROMPT_LEN, (1,), generator=gen))
        rows.append(doc[start: start + PROMPT_LEN])
    return torch.tensor(rows)


# ----------------------------------------------------------------------------------------------- model
def load_target():
    from transformers import DeepseekV4ForCausalLM

    target = DeepseekV4ForCausalLM.from_pretrained(ASSET, dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return target


class DraftLayer(nn.Module):
    """The MTP layer of ``deepseek_v4/mtp.py`` in HF transformers' modules (trainable)."""

    def __init__(self, target):
        super().__init__()
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

        config = target.config
        draft = type(config)(**{**config.to_dict(), "num_hidden_layers": 1, "layer_types": ["sliding_attention"],
                                "mlp_layer_types": ["moe"]})
        D = config.hidden_size
        self.window = config.sliding_window
        self.enorm = hf.DeepseekV4RMSNorm(D, eps=config.rms_norm_eps)
        self.hnorm = hf.DeepseekV4RMSNorm(D, eps=config.rms_norm_eps)
        self.e_proj = nn.Linear(D, D, bias=False)
        self.h_proj = nn.Linear(D, D, bias=False)
        self.block = hf.DeepseekV4DecoderLayer(draft, 0)
        self.hc_head = hf.DeepseekV4HyperHead(config)
        self.norm = hf.DeepseekV4RMSNorm(D, eps=config.rms_norm_eps)
        self.confidence_head = nn.Linear(D, 1)
        self._init_from(target)

    @torch.no_grad()
    def _init_from(self, target) -> None:
        missing, _ = self.block.load_state_dict(target.model.layers[-1].state_dict(), strict=False)
        assert not missing, f"block parameters not initialised from the target: {missing}"
        self.hc_head.load_state_dict(target.model.hc_head.state_dict())
        self.norm.load_state_dict(target.model.norm.state_dict())
        for norm in (self.enorm, self.hnorm):
            norm.weight.fill_(1.0)
        gen = torch.Generator().manual_seed(SEED + 2)
        D = self.h_proj.weight.shape[0]
        self.h_proj.weight.copy_(torch.eye(D))
        self.e_proj.weight.copy_(torch.randn(D, D, generator=gen) * D**-0.5)
        self.confidence_head.weight.zero_()
        self.confidence_head.bias.zero_()

    def forward(self, target, hidden, next_ids, positions):
        """``hidden [B, T, hc, D]`` and ``next_ids [B, T]`` at ``positions [T]`` -> (streams, final ``[B, T, D]``)."""
        model = target.model
        e = model.embed_tokens(next_ids) * (positions != 0)[None, :, None]
        x = self.h_proj(self.hnorm(hidden)) + self.e_proj(self.enorm(e)).unsqueeze(2)  # [B, T, hc, D]
        i, j = positions[:, None], positions[None, :]
        mask = torch.where((j <= i) & (i - j < self.window), 0.0, float("-inf"))[None, None]
        pos = positions[None]
        emb = {t: model.rotary_emb(e, position_ids=pos, layer_type=t) for t in ("main", "compress")}
        streams = self.block(x, position_embeddings=emb, position_ids=pos, attention_mask=mask)
        return streams, self.norm(self.hc_head(streams))


@torch.no_grad()
def load_draft_layer(draft: DraftLayer, folder: Path, config) -> None:
    """Continue from the ``mtp.0.*`` tensors of ``folder``'s checkpoint (inverse of :func:`mtp_tensors`)."""
    from safetensors.torch import load_file

    from deepinfer_core.models.deepseek_v4.weights import hf_layer_tensors

    stored = load_file(folder / "model.safetensors")
    for key, value in draft.block.state_dict().items():
        for name, view in hf_layer_tensors({key: value}, "mtp.0", config):
            view.copy_(stored[name])
    for name, param in own_parameters(draft).items():
        param.copy_(stored[name])


def target_pass(target, ids):
    """The target's last streams ``[B, T, hc, D]`` (the input of its hc_head) and logits ``[B, T, V]``."""
    captured = {}

    def keep(module, args, output) -> None:
        captured["s"] = args[0]

    handle = target.model.hc_head.register_forward_hook(keep)
    try:
        with torch.no_grad():
            logits = target(input_ids=ids, use_cache=False).logits.float()
    finally:
        handle.remove()
    return captured["s"], logits


def soft_ce(logits, teacher_logits):
    return -(teacher_logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()


def train_layer(target, draft: DraftLayer, windows: torch.Tensor, steps: int, start: int = 0,
                peak_lr: float = PEAK_LR) -> list[tuple[int, float, float]]:
    """Train the MTP layer (not its confidence head) on ``steps`` batches from window batch ``start`` on, warmup
    then cosine decay from ``peak_lr``; returns the loss curve (steps counted from ``start``)."""
    params = [p for n, p in draft.named_parameters() if not n.startswith("confidence_head")]
    opt = torch.optim.AdamW(params, lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.0)
    head = target.lm_head
    curve, run1, run2, t0 = [], 0.0, 0.0, time.time()
    for step in range(steps):
        lr = peak_lr * min(1.0, (step + 1) / WARMUP_STEPS) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        ids = windows[(start + step) * BATCH_SIZE: (start + step + 1) * BATCH_SIZE]
        T = ids.shape[1]
        streams, logits = target_pass(target, ids)
        s1, f1 = draft(target, streams[:, : T - 1], ids[:, 1:], torch.arange(T - 1))  # row i predicts t[i + 2]
        loss1 = soft_ce(head(f1[:, : T - 2]), logits[:, 1: T - 1])
        greedy = logits.argmax(-1)  # [B, T]: the target's token after each position
        _, f2 = draft(target, s1[:, : T - 2], greedy[:, 1: T - 1], torch.arange(1, T - 1))  # predicts t[i + 3]
        loss2 = soft_ce(head(f2[:, : T - 3]), logits[:, 2: T - 1])
        loss = loss1 + CHAIN_WEIGHT * loss2
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        run1, run2 = run1 + loss1.item(), run2 + loss2.item()
        if (step + 1) % LOG_EVERY == 0:
            curve.append((start + step + 1, run1 / LOG_EVERY, run2 / LOG_EVERY))
            log(f"step {start + step + 1}/{start + steps} draft loss {run1 / LOG_EVERY:.3f} chained {run2 / LOG_EVERY:.3f} "
                f"({time.time() - t0:.0f}s)")
            run1 = run2 = 0.0
    return curve


# ------------------------------------------------------------------------------------------- checkpoint
def own_parameters(draft: DraftLayer) -> dict[str, torch.Tensor]:
    """The draft layer's parameters outside its block (and confidence head), by DeepSeek name."""
    return {"mtp.0.enorm.weight": draft.enorm.weight, "mtp.0.hnorm.weight": draft.hnorm.weight,
            "mtp.0.e_proj.weight": draft.e_proj.weight, "mtp.0.h_proj.weight": draft.h_proj.weight,
            "mtp.0.norm.weight": draft.norm.weight, "mtp.0.hc_head_fn": draft.hc_head.hc_fn,
            "mtp.0.hc_head_base": draft.hc_head.hc_base, "mtp.0.hc_head_scale": draft.hc_head.hc_scale}


def mtp_tensors(draft: DraftLayer, config) -> dict[str, torch.Tensor]:
    """``mtp.0.*`` in DeepSeek's names: matrices bf16 (as the target's), fp32 for what the model keeps fp32."""
    from deepinfer_core.models.deepseek_v4.model import keeps_fp32
    from deepinfer_core.models.deepseek_v4.weights import hf_layer_tensors

    out = own_parameters(draft)
    out["mtp.0.confidence_head.weight"] = draft.confidence_head.weight
    out["mtp.0.confidence_head.bias"] = draft.confidence_head.bias
    out.update(hf_layer_tensors(draft.block.state_dict(), "mtp.0", config))
    shipped = {}
    for name, t in out.items():
        t = t.detach().contiguous()
        if t.dtype.is_floating_point:
            t = t.float() if keeps_fp32(name) or "confidence_head" in name else t.to(torch.bfloat16)
        shipped[name] = t.clone()
    return shipped


def tensor_hashes(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return {n: hashlib.sha256(f.get_tensor(n).view(torch.uint8).numpy().tobytes()).hexdigest()
                for n in f.keys() if not n.startswith("mtp.")}  # noqa: SIM118


def write_checkpoint(folder: Path, extra: dict[str, torch.Tensor]) -> None:
    """The shipped folder's files in ``folder``, model.safetensors = the target's tensors unchanged + ``extra``."""
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    for f in ASSET.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, folder / f.name)
    tensors = {n: t for n, t in load_file(ASSET / "model.safetensors").items() if not n.startswith("mtp.")}
    tensors.update(extra)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# ------------------------------------------------------------------------------------ drafting, measured
def greedy_continuations(target, prompt_ids: torch.Tensor, new_tokens: int = GEN_LEN) -> torch.Tensor:
    """``[S, PROMPT_LEN + new_tokens]``: each prompt and the target's greedy continuation."""
    with torch.no_grad():
        return target.generate(prompt_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=2)


def engine_models(folder: Path):
    from deepinfer_core.models.deepseek_v4.loader import load_deepseek_v4
    from deepinfer_core.models.deepseek_v4.mtp import load_mtp_draft
    from deepinfer_core.ops.table import OpTable

    target = load_deepseek_v4(folder, OpTable())
    return target, load_mtp_draft(folder, target)


def engine_hidden(target, seqs: torch.Tensor) -> torch.Tensor:
    """The engine target's last streams ``[S, L, hc, D]`` over whole sequences."""
    from deepinfer_core.forward_batch import ForwardBatch

    S, L = seqs.shape
    blocks = -(-L // target.block_multiple)
    state = target.new_state(S, S * blocks)
    tables = [list(range(s * blocks, (s + 1) * blocks)) for s in range(S)]
    batch = ForwardBatch.build(seqs.tolist(), [0] * S, list(range(S)), tables)
    last = target.config.num_hidden_layers - 1
    streams = target.forward(batch, state, capture_layers=[last]).hidden_states[last]  # [S * L, hc, D]
    return streams.view(S, L, *streams.shape[1:])


def draft_rounds(draft, seqs: torch.Tensor, hidden: torch.Tensor, k: int, allocate=None):
    """Greedy speculative decoding of ``seqs`` (prompt + the target's greedy continuation) as the engine runs it:
    each round commits the newly verified draft rows, drafts ``k`` tokens per sequence, verifies a prefix of each
    (all ``k``, or ``allocate(confidences [A][k]) -> lengths``) and moves on by the accepted tokens plus the target's
    own. Yields per round ``(drafts, matches [A] of the whole k, lengths [A] verified, alive)``."""
    from deepinfer_core.forward_batch import ForwardBatch

    S, L = seqs.shape
    state = draft.new_state(S)
    committed = [0] * S
    computed = [PROMPT_LEN] * S  # after the prefill: t[PROMPT_LEN] is the newest token
    while True:
        alive = [s for s in range(S) if computed[s] + k < L]
        if not alive:
            return
        rows = [seqs[s, committed[s] + 1: computed[s] + 1].tolist() for s in alive]
        batch = ForwardBatch.build(rows, [committed[s] for s in alive], alive, [[] for _ in alive])
        hid = torch.cat([hidden[s, committed[s]: computed[s]] for s in alive])
        drafts = draft.propose(batch, state, hid, k)
        truth = torch.stack([seqs[s, computed[s] + 1: computed[s] + 1 + k] for s in alive])  # [A, k]
        matches = (drafts.token_ids == truth).long().cumprod(-1).sum(-1)  # [A]
        lengths = torch.full_like(matches, k) if allocate is None else torch.tensor(allocate(drafts.confidence))
        yield drafts, matches, lengths, alive
        accepted = torch.minimum(matches, lengths)
        for i, s in enumerate(alive):
            committed[s] = computed[s]
            computed[s] += int(accepted[i]) + 1


def acceptance(draft, seqs, hidden, k: int, allocate=None) -> tuple[float, float, int]:
    """(acceptance length ``1 + accepted / draft rounds``, verified draft tokens per round, rounds)."""
    accepted = rounds = verified = 0
    for _, matches, lengths, alive in draft_rounds(draft, seqs, hidden, k, allocate):
        accepted += int(torch.minimum(matches, lengths).sum())
        verified += int(lengths.sum())
        rounds += len(alive)
    return 1 + accepted / rounds, verified / rounds, rounds


def confidence_samples(draft, seqs, hidden, k: int):
    """(draft hidden ``[N, D]``, accepted ``[N]``) for every draft position up to each round's first rejection."""
    feats, labels = [], []
    for drafts, matches, _, alive in draft_rounds(draft, seqs, hidden, k):
        for i in range(len(alive)):
            n = min(int(matches[i]) + 1, k)
            feats.append(drafts.hidden[i, :n])
            labels.append((torch.arange(n) < int(matches[i])).float())
    return torch.cat(feats).float(), torch.cat(labels)


def fit_confidence(feats: torch.Tensor, labels: torch.Tensor, steps: int = 400) -> tuple[nn.Linear, float, float]:
    """Logistic regression on a seeded 80/20 split: the head, held-out log loss and the base rate's log loss."""
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SEED + 3))
    cut = int(0.8 * len(perm))
    tr, va = perm[:cut], perm[cut:]
    head = nn.Linear(feats.shape[1], 1)
    with torch.no_grad():
        head.weight.zero_()
        p = labels[tr].mean().clamp(1e-3, 1 - 1e-3)
        head.bias.fill_(math.log(p / (1 - p)))
    opt = torch.optim.Adam(head.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(steps):
        loss = F.binary_cross_entropy_with_logits(head(feats[tr]).squeeze(-1), labels[tr])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        val = F.binary_cross_entropy_with_logits(head(feats[va]).squeeze(-1), labels[va]).item()
        base_rate = labels[tr].mean()
        prior = F.binary_cross_entropy(base_rate.expand(len(va)), labels[va]).item()
    return head, val, prior


# ------------------------------------------------------------------------------------------------ main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--out", type=Path, default=ASSET)
    ap.add_argument("--resume", type=Path, help="continue training the draft layer of this checkpoint folder")
    ap.add_argument("--start-step", type=int, default=0, help="with --resume: the steps already run (data offset)")
    ap.add_argument("--peak-lr", type=float, default=PEAK_LR)
    ap.add_argument("--measure-only", action="store_true", help="measure the draft layer of --out, train nothing")
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    t_start = time.time()
    windows, train_docs, held_docs = token_splits()
    target = load_target()
    held = greedy_continuations(target, prompts(held_docs, HELDOUT_PROMPTS, SEED + 4))
    log(f"held-out: {held.shape[0]} prompts of {PROMPT_LEN} tokens + {GEN_LEN} greedy tokens")
    if args.measure_only:
        print(json.dumps(measure(args.out, held), indent=2), flush=True)
        return 0

    draft = DraftLayer(target)
    if args.resume is not None:
        load_draft_layer(draft, args.resume, target.config)
    curve = train_layer(target, draft, windows, args.steps, args.start_step, args.peak_lr)
    work = Path(tempfile.mkdtemp(prefix="tiny_mtp_"))
    write_checkpoint(work, mtp_tensors(draft, target.config))
    engine_target, engine_draft = engine_models(work)
    calib = greedy_continuations(target, prompts(train_docs, CONFIDENCE_PROMPTS, SEED + 5))
    feats, labels = confidence_samples(engine_draft, calib, engine_hidden(engine_target, calib), K)
    head, val_loss, prior_loss = fit_confidence(feats, labels)
    log(f"confidence head: {len(labels)} samples (accepted {labels.mean():.2f}); held-out log loss {val_loss:.3f} "
        f"vs base rate {prior_loss:.3f}")
    with torch.no_grad():
        draft.confidence_head.weight.copy_(head.weight)
        draft.confidence_head.bias.copy_(head.bias)
    write_checkpoint(work, mtp_tensors(draft, target.config))
    before = tensor_hashes(ASSET / "model.safetensors")
    after = tensor_hashes(work / "model.safetensors")
    assert before == after, "a target tensor changed"
    log(f"target tensors bit-identical: {len(after)} tensors, sha256 each")
    result = measure(work, held)
    result.update(steps=args.start_step + args.steps, curve=curve, resumed_at=args.start_step, peak_lr=args.peak_lr,
                  confidence_samples=len(labels), confidence_val_log_loss=val_loss,
                  confidence_prior_log_loss=prior_loss, minutes=round((time.time() - t_start) / 60, 1))
    size_before = (ASSET / "model.safetensors").stat().st_size
    result.update(size_before_mb=round(size_before / 1e6, 2),
                  size_after_mb=round((work / "model.safetensors").stat().st_size / 1e6, 2))
    write_card(work / "MODEL_CARD.md", result)
    args.out.mkdir(parents=True, exist_ok=True)
    for f in work.iterdir():
        shutil.copy(f, args.out / f.name)
    shutil.rmtree(work)
    log(f"model.safetensors {size_before / 1e6:.2f} MB -> {(args.out / 'model.safetensors').stat().st_size / 1e6:.2f}"
        f" MB")
    print(json.dumps(result, indent=2), flush=True)
    return 0


CARD_SECTION = "## MTP draft layer and confidence head"


def write_card(path: Path, result: dict) -> None:
    """Put this run's section into the model card (replacing an earlier one)."""
    rows = "\n".join(f"| dspark, verify_fraction {d['verify_fraction']} | {d['verified_per_round']:.2f} | "
                     f"{d['acceptance_length']:.3f} |" for d in result["dspark"])
    curve = "\n".join(f"| {step} | {l1:.3f} | {l2:.3f} |" for step, l1, l2 in result["curve"][4::5])
    resumed = (f" (steps {result['resumed_at'] + 1}.. resumed from an earlier run's layer at peak lr "
               f"{result['peak_lr']})" if result["resumed_at"] else f", AdamW peak lr {result['peak_lr']}")
    section = f"""{CARD_SECTION}

`mtp.0.*` (DeepSeek's names; HF transformers ignores them): enorm, hnorm, e_proj, h_proj, one sliding-window
decoder block with a routed MoE, hc_head, norm, and a confidence head (`confidence_head.weight` / `.bias`); the
embedding and head are the target's. Trained by `python tools/train_tiny_mtp.py` with the target frozen (its
tensors are copied unchanged: sha256 of every one checked), on the same train split and windows:
{result['steps']} steps of {BATCH_SIZE} x {SEQ_LEN} tokens{resumed}, soft cross-entropy against the
target's next-next distribution, plus a chained pass on the layer's own streams (weight {CHAIN_WEIGHT}); the block
starts from the target's last layer. The confidence head is a logistic regression on {result['confidence_samples']}
draft positions of the engine's k = 5 drafts over train-split prompts (label: the drafted token equals the target's
greedy token, positions up to each round's first rejection): held-out log loss
{result['confidence_val_log_loss']:.3f} vs {result['confidence_prior_log_loss']:.3f} for the base rate.
model.safetensors: {result['size_before_mb']} MB -> {result['size_after_mb']} MB. Whole run:
{result['minutes']} minutes on 2 shared CPU cores.

| step | draft loss | chained loss |
|---|---|---|
{curve}

Acceptance on held-out code ({HELDOUT_PROMPTS} prompts of {PROMPT_LEN} tokens from the held-out files, the target's
{GEN_LEN} greedy tokens each; k = 5, greedy verification, drafting as the engine drafts; acceptance length =
1 + accepted / draft rounds):

| verification | verified draft tokens per round | acceptance length |
|---|---|---|
| mtp (every draft token) | {result['verified_per_round_k5']:.2f} | **{result['acceptance_length_k5']:.3f}** |
{rows}

Reproduce: `python tools/train_tiny_mtp.py` (after `tools/train_tiny.py`, which writes a target without the draft
layer); `python tools/train_tiny_mtp.py --measure-only` measures the shipped layer.
"""
    card = path.read_text()
    card = card.replace("- No MTP layer (num_nextn_predict_layers 0).",
                        "- One MTP draft layer (num_nextn_predict_layers 1), trained after the target: see below.")
    if CARD_SECTION in card:
        start = card.index(CARD_SECTION)
        end = card.find("\n## ", start + 1)
        card = card[:start] + section + (card[end + 1:] if end >= 0 else "")
    else:
        start = card.index("## License")
        card = card[:start] + section + "\n" + card[start:]
    path.write_text(card)


def measure(folder: Path, held: torch.Tensor) -> dict:
    """Acceptance length at k = 5 with every draft token verified (``mtp``), then with DSpark's allocation at
    budgets of ``VERIFY_FRACTIONS`` x the drafts (``dspark``), on the held-out continuations."""
    from deepinfer_dspark import allocate_verification

    engine_target, engine_draft = engine_models(folder)
    hidden = engine_hidden(engine_target, held)
    length, verified, rounds = acceptance(engine_draft, held, hidden, K)
    log(f"held-out acceptance length at k={K} (greedy, every draft verified): {length:.3f} over {rounds} draft rounds")
    result = {"acceptance_length_k5": length, "verified_per_round_k5": verified, "rounds": rounds, "dspark": []}
    for fraction in VERIFY_FRACTIONS:
        def allocate(confidence, fraction=fraction):
            return allocate_verification(confidence.tolist(), round(fraction * confidence.numel()))

        d_length, d_verified, d_rounds = acceptance(engine_draft, held, hidden, K, allocate)
        log(f"  dspark verify_fraction {fraction}: acceptance length {d_length:.3f} ({d_length / length:.1%} of mtp's) "
            f"with {d_verified:.2f} verified tokens per round ({d_verified / verified:.1%}), {d_rounds} rounds")
        result["dspark"].append({"verify_fraction": fraction, "acceptance_length": d_length,
                                 "verified_per_round": d_verified, "rounds": d_rounds})
    return result


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python
"""Held-out perplexity of the embedded tiny model quantized as DeepSeek ships V4 checkpoints (issue 31).

The held-out text and the perplexity are ``tools/train_tiny.py``'s: the first 64 windows of 512 tokens of the
held-out split of the Python standard library, token-level perplexity of the next token. Each recipe is written with
``deepinfer quantize``'s writer from the shipped weights; HF transformers (fp32) runs the exact dequantization (what
the engine's reference ops compute: tests/test_quantized_model.py), and the engine itself runs the first windows as
a check. Writes the table into deepinfer_core/assets/tiny_v4/MODEL_CARD.md (section "Quantized") and prints it.

Usage::

    python tools/quantized_perplexity.py          # ~5 minutes on 2 CPU cores
"""

from __future__ import annotations

import json
import math
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny import BOS, DEFAULT_OUT, EOS, EVAL_TOKENS, SEQ_LEN, corpus_files, heldout_nll, is_heldout, read_texts

from deepinfer_core.bench.presets import hf_saved_name
from deepinfer_core.checkpoint import write_checkpoint
from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.models.deepseek_v4.loader import load_deepseek_v4
from deepinfer_core.ops.table import OpTable
from deepinfer_core.quant.writer import QuantRecipe, dequantized_tensors, quantize_checkpoint

RECIPES = {
    "fp4 experts, fp8 linears, 128 x 128 ue8m0 blocks (as V4-Flash)": QuantRecipe("fp4", "fp8", 128),
    "fp4 experts, fp8 linears, 32 x 32 ue8m0 blocks (as V4.1-Flash)": QuantRecipe("fp4", "fp8", 32),
    "fp8 experts, fp8 linears, 128 x 128 float32 blocks (as V4-Flash-Base)": QuantRecipe("fp8", "fp8", 128),
}
ENGINE_CHECK_WINDOWS = 4
CARD_HEADING = "## Quantized"


def heldout_windows(tokenizer_file: Path) -> torch.Tensor:
    """``train_tiny.py``'s evaluation windows ``[64, 512]``, encoded with the shipped tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rels, texts = read_texts(stdlib, corpus_files(stdlib))
    held = [texts[i] for i, rel in enumerate(rels) if is_heldout(rel)]
    stream = []
    for encoding in tok.encode_batch(held, add_special_tokens=False):
        stream += [tok.token_to_id(BOS), *encoding.ids, tok.token_to_id(EOS)]
    return torch.tensor(stream[:EVAL_TOKENS], dtype=torch.long).view(-1, SEQ_LEN)


def hf_on(folder: Path, out: Path):
    """HF DeepseekV4ForCausalLM (fp32) on the exact dequantization of ``folder``."""
    from transformers import DeepseekV4ForCausalLM

    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config"), config.pop("expert_dtype")
    write_checkpoint(out, {hf_saved_name(n): t for n, t in dequantized_tensors(folder)}, config)
    return DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


@torch.no_grad()
def engine_nll(folder: Path, windows: torch.Tensor) -> float:
    """The engine's (reference ops, fp32) mean next-token NLL over ``windows``, one window per step."""
    model = load_deepseek_v4(folder, OpTable(), dtype=torch.float32)
    total, count = 0.0, 0
    for window in windows.tolist():
        state = model.new_state(num_slots=1, num_blocks=SEQ_LEN // 128 + 2, block_size=128)
        batch = ForwardBatch.build([window], [0], [0], [list(range(SEQ_LEN // 128 + 2))], logits="all")
        logp = torch.log_softmax(model.forward(batch, state).logits[:-1], dim=-1)
        total -= logp.gather(-1, torch.tensor(window[1:])[:, None]).sum().item()
        count += len(window) - 1
    return total / count


def main() -> int:
    from transformers import DeepseekV4ForCausalLM

    torch.set_num_threads(2)
    windows = heldout_windows(DEFAULT_OUT / "tokenizer.json")
    rows = []
    shipped_nll, n_targets = heldout_nll(DeepseekV4ForCausalLM.from_pretrained(DEFAULT_OUT, dtype=torch.float32),
                                         windows)
    rows.append(("as trained (shipped bf16 weights, run in fp32)", math.exp(shipped_nll), None, None))
    print(f"shipped: ppl {math.exp(shipped_nll):.2f} on {n_targets} tokens", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for label, recipe in RECIPES.items():
            folder = Path(tmp) / f"q{len(rows)}"
            quantize_checkpoint(DEFAULT_OUT, folder, recipe)
            size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
            nll, _ = heldout_nll(hf_on(folder, Path(tmp) / f"d{len(rows)}"), windows)
            check = abs(engine_nll(folder, windows[:ENGINE_CHECK_WINDOWS])
                        - heldout_nll(hf_on(folder, Path(tmp) / f"e{len(rows)}"), windows[:ENGINE_CHECK_WINDOWS])[0])
            rows.append((label, math.exp(nll), size, check))
            print(f"{label}: ppl {math.exp(nll):.2f}, {size / 1e6:.2f} MB, engine vs HF NLL {check:.1e}", flush=True)
    write_card_section(rows, n_targets)
    return 0


def write_card_section(rows, n_targets: int) -> None:
    shipped = sum(p.stat().st_size for p in DEFAULT_OUT.glob("*.safetensors"))
    lines = [CARD_HEADING, "",
             (f"Held-out perplexity (the evaluation above: {n_targets:,} predicted tokens) with the weights quantized "
             "by `deepinfer quantize` (round to nearest) from the shipped weights; the embedding, head, router, "
             "norms, sinks and mHC weights stay as stored. HF transformers runs the exactly dequantized weights in "
             "fp32, which is what the engine's reference ops compute (the engine on the first "
             f"{ENGINE_CHECK_WINDOWS} windows agrees to the NLL difference shown)."), "",
             "| weights | held-out perplexity | vs as trained | weights file | engine vs HF NLL |",
             "|---|---|---|---|---|"]
    base = rows[0][1]
    for label, ppl, size, check in rows:
        size = size or shipped
        delta = "" if check is None else f"{100 * (ppl / base - 1):+.2f}%"
        lines.append(f"| {label} | {ppl:.2f} | {delta} | {size / 1e6:.2f} MB | "
                     f"{'' if check is None else f'{check:.1e}'} |")
    lines += ["", ("Reproduce: `python tools/quantized_perplexity.py` (rewrites this section; rerun it after "
              "`tools/train_tiny.py`). Only the bf16 weights ship: a quantized copy would add megabytes to the "
              "package for no use on CPU."), ""]
    card = (DEFAULT_OUT / "MODEL_CARD.md").read_text()
    before, _, after = card.partition(CARD_HEADING)
    rest = after[after.find("\n## "):] if "\n## " in after else ""
    if not after:  # first time: before the license
        before, _, rest = card.partition("## License")
        rest = "## License" + rest
    (DEFAULT_OUT / "MODEL_CARD.md").write_text(before + "\n".join(lines) + ("\n" + rest.lstrip("\n") if rest else ""))
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())

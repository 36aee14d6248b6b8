"""Mask time per token and compile time of llguidance and xgrammar on one JSON schema, with a checkpoint's tokenizer.

    python plugins/structured_output/compare_backends.py                 # the embedded tiny model's tokenizer
    PYTHONPATH=/tmp/xg:/tmp/xgdeps python plugins/structured_output/compare_backends.py [--model DIR]

xgrammar is measured only where it imports (it is not a dependency: install it into a scratch target, e.g.
``pip install --no-deps --target /tmp/xg xgrammar==0.2.9`` and ``pip install --no-deps --target /tmp/xgdeps
apache-tvm-ffi``; it also needs pydantic and transformers, which the dev venv has). Each library drives one matcher
through the tokens of fixed documents that satisfy the schema: per token it computes the bitmask of the next
allowed tokens, then accepts the token, single-threaded on the host. Results: README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import tokenizers

SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "tags", "address", "active", "score"],
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["admin", "user", "guest"]}, "maxItems": 3},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
    },
}
DOCUMENTS = [
    {"id": 42, "name": "Ada Lovelace", "tags": ["admin", "user"], "address": {"city": "London", "zip": "12345"},
     "active": True, "score": 9.5},
    {"id": 7, "name": "Grace Hopper", "tags": [], "address": {"city": "Arlington", "zip": "22201"},
     "active": False, "score": -0.25},
]
REPEATS = 20


def _docs(tokenizer: tokenizers.Tokenizer) -> list[list[int]]:
    return [tokenizer.encode(json.dumps(d, separators=(",", ":")), add_special_tokens=False).ids for d in DOCUMENTS]


def measure_llguidance(tokenizer_json: str, vocab: int, eos: int, docs: list[list[int]]) -> dict:
    import llguidance
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    started = time.perf_counter()
    tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
    tokenizer_s = time.perf_counter() - started
    started = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), overrides={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(tok, grammar)
    compile_s = time.perf_counter() - started
    bitmask = allocate_token_bitmask(1, vocab)
    times = []
    for _ in range(REPEATS):
        for ids in docs:
            matcher = llguidance.LLMatcher(tok, grammar)
            for token in ids:
                t0 = time.perf_counter()
                fill_next_token_bitmask(matcher, bitmask, 0)
                times.append(time.perf_counter() - t0)
                assert matcher.consume_token(token), matcher.get_error()
            assert matcher.is_accepting()
    return {"tokenizer_s": tokenizer_s, "compile_s": compile_s, "mask_us": _us(times)}


def measure_xgrammar(model_dir: Path, vocab: int, docs: list[list[int]]) -> dict | str:
    try:
        import transformers
        import xgrammar as xgr
    except ImportError as exc:
        return f"not measured: {exc}"
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"), eos_token="<|eos|>")
    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    tokenizer_s = time.perf_counter() - started
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - started
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for _ in range(REPEATS):
        for ids in docs:
            matcher = xgr.GrammarMatcher(compiled)
            for token in ids:
                t0 = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                times.append(time.perf_counter() - t0)
                assert matcher.accept_token(token)
    return {"tokenizer_s": tokenizer_s, "compile_s": compile_s, "mask_us": _us(times)}


def _us(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"mean": statistics.fmean(times) * 1e6, "p50": ordered[len(ordered) // 2] * 1e6,
            "p99": ordered[int(len(ordered) * 0.99)] * 1e6, "tokens": len(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: the embedded tiny model)")
    args = parser.parse_args()
    import deepinfer_core

    model_dir = args.model or Path(deepinfer_core.__file__).parent / "assets" / "tiny_v4"
    tokenizer_json = (model_dir / "tokenizer.json").read_text(encoding="utf-8")
    tokenizer = tokenizers.Tokenizer.from_str(tokenizer_json)
    config = json.loads((model_dir / "config.json").read_text())
    vocab = max(int(config.get("vocab_size", 0)), tokenizer.get_vocab_size())
    eos = config.get("eos_token_id", 1)
    eos = eos[0] if isinstance(eos, list) else eos
    docs = _docs(tokenizer)
    print(json.dumps({"model": str(model_dir), "vocab": vocab, "tokens_per_pass": sum(map(len, docs)),
                      "llguidance": measure_llguidance(tokenizer_json, vocab, eos, docs),
                      "xgrammar": measure_xgrammar(model_dir, vocab, docs)}, indent=2))


if __name__ == "__main__":
    main()

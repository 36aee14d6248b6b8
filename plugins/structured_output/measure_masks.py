"""Host time of a batch's token masks, as the plugin computes them each step (``StructuredOutputProcessor.prepare``).

    python plugins/structured_output/measure_masks.py                       # 129,280-id byte-level tokenizer
    python plugins/structured_output/measure_masks.py --vocab 4096 --batch 16 64

``B`` rows, each its own matcher of one JSON schema (``deepinfer bench --json-schema``'s kind: an array of objects
with integers, short strings, enums, numbers and booleans), step through a document: every step ``prepare`` advances
each matcher by the row's new token and fills the batch's packed masks (llguidance's LLExecutor, in parallel), then
each row takes the next token of its document. The tokenizer is the benchmarks' synthetic byte-level BPE
(``deepinfer_core.bench.byte_tokenizer``) at ``--vocab`` ids: DeepSeek-V4 has 129,280. Prints per batch size the mean
and p50 / p99 of a step's wall time and the mean per row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from deepinfer_structured_output.processor import StructuredOutputProcessor

from deepinfer_core.bench.byte_tokenizer import write_byte_bpe_tokenizer
from deepinfer_core.sampling import LogitsRow, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "array", "minItems": 1, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "tags", "score", "ok"],
    "properties": {"id": {"type": "integer", "minimum": 0}, "name": {"type": "string", "maxLength": 12},
                   "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["red", "green", "blue", "amber"]}},
                   "score": {"type": "number"}, "ok": {"type": "boolean"}}}}


def document(i: int) -> str:
    items = [{"id": 1000 * i + k, "name": f"item {k} of {i}"[:12], "tags": ["red", "amber"][: k % 3],
              "score": k * 0.25 - 3, "ok": k % 2 == 0} for k in range(40)]
    return json.dumps(items, separators=(",", ":"))


def measure(processor: StructuredOutputProcessor, tokenize, batch: int, steps: int) -> list[float]:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    processor.validate_params(params)
    docs = [tokenize(document(i)) for i in range(batch)]
    times = []
    for step in range(min(steps, min(len(d) for d in docs))):
        rows = [LogitsRow(f"m{batch}-{i}", params, [0], docs[i][:step], step) for i in range(batch)]
        start = time.perf_counter()
        processor.prepare(rows)
        times.append(time.perf_counter() - start)
    return times[1:]  # the first step builds the matchers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=129280, help="tokenizer size (default 129280, DeepSeek-V4's)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64], help="rows per step (default 1 16 64)")
    parser.add_argument("--steps", type=int, default=200, help="steps per batch size (default 200)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    write_byte_bpe_tokenizer(folder, args.vocab)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    processor = StructuredOutputProcessor((folder / "tokenizer.json").read_text(), args.vocab, eos_token_id=1)
    for batch in args.batch:
        times = sorted(measure(processor, lambda text: tok.encode(text).ids, batch, args.steps))
        mean = statistics.mean(times)
        print(f"batch {batch:4d}: step mean {1e3 * mean:7.3f} ms, p50 {1e3 * times[len(times) // 2]:7.3f} ms, "
              f"p99 {1e3 * times[int(0.99 * (len(times) - 1))]:7.3f} ms; {1e6 * mean / batch:7.1f} us per row "
              f"({len(times)} steps)")


if __name__ == "__main__":
    main()

"""Where a step's token masks are computed relative to the engine's own host work, on the CPU in the GPU's order.

    python plugins/structured_output/measure_overlap.py --preset tiny \\
        --json-schema plugins/structured_output/bench_schema.json --num-prompts 64 --max-num-seqs 64 \\
        --input-len 32 --output-len 128 --async-scheduling

Runs ``deepinfer bench`` with the arguments given. On the CPU a launched step has finished when launching returns, so
the engine would start ``prepare`` before the forward pass; here every launched step reports its tokens as not yet on
the host (``LaunchedStep.is_ready`` returns False), so a step runs as on a GPU: forward queued, previous tokens read,
``prepare`` started, previous step applied, sampling queued. Prints, besides the bench's report, the medians over
``prepare`` calls of: when the worker thread began it (after it was submitted), when the sampler took the masks, and
how long the sampler waited for them.
"""

from __future__ import annotations

import statistics
import sys
import time

from deepinfer_core.engine import logits_preparer, model_runner

_times: dict[str, list[float]] = {"began": [], "taken": [], "waited": []}
_submitted = [0.0]


def _instrument() -> None:
    model_runner.LaunchedStep.is_ready = lambda self: False
    start, prepare, result = (logits_preparer.LogitsPreparer.start, logits_preparer.LogitsPreparer._prepare,
                              logits_preparer.PreparedHandle.result)

    def timed_start(self, *args, **kwargs):
        _submitted[0] = time.perf_counter()
        return start(self, *args, **kwargs)

    def timed_prepare(self, *args, **kwargs):
        _times["began"].append(time.perf_counter() - _submitted[0])
        return prepare(self, *args, **kwargs)

    def timed_result(self):
        waited = self._stats.wait_s
        handle = result(self)
        _times["taken"].append(time.perf_counter() - _submitted[0])
        _times["waited"].append(self._stats.wait_s - waited)
        return handle

    logits_preparer.LogitsPreparer.start = timed_start
    logits_preparer.LogitsPreparer._prepare = timed_prepare
    logits_preparer.PreparedHandle.result = timed_result


def main() -> int:
    _instrument()
    from deepinfer_core.cli.main import main as cli

    code = cli(["bench", *sys.argv[1:]])
    if _times["began"]:
        ms = {name: 1e3 * statistics.median(values) for name, values in _times.items()}
        print(f"masks, medians over {len(_times['began'])} prepares: the worker began {ms['began']:.2f} ms after "
              f"submission, the sampler took them {ms['taken']:.2f} ms after it and waited {ms['waited']:.2f} ms")
    return code


if __name__ == "__main__":
    sys.exit(main())

"""``benchmarks/quant_accuracy.py``: its measures on hand-made runs, and the tool end to end on a quantized tiny
checkpoint on the CPU backend (where both runs take the same reference ops, so they must agree exactly)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import quant_accuracy

REPO = Path(__file__).resolve().parents[3]


def test_greedy_agreement_counts_tokens_before_the_first_difference_and_near_ties():
    reference = [[(5, 1.0), (6, 1.0), (7, 1.0)],  # identical
                 [(5, 1.0), (6, 0.01), (7, 1.0)],  # parts at step 1, a near-tie
                 [(1, 0.5), (2, 1.0), (3, 1.0)]]  # parts at step 0, not a near-tie
    other = [[5, 6, 7], [5, 9, 9], [4, 2, 3]]
    agreement = quant_accuracy.greedy_agreement(reference, other, tie_gap=0.05)
    assert (agreement.prompts, agreement.tokens, agreement.matched) == (3, 3, 4)
    assert (agreement.identical, agreement.near_ties) == (1, 1)
    assert agreement.fraction == pytest.approx(4 / 9)


def test_greedy_agreement_refuses_runs_of_different_lengths():
    with pytest.raises(ValueError):
        quant_accuracy.greedy_agreement([[(1, 1.0), (2, 1.0)]], [[1]], tie_gap=0.05)


def test_logprob_differences_pair_positions():
    assert quant_accuracy.logprob_differences([[-1.0, -2.0], [-0.5]], [[-1.5, -2.0], [-0.25]]) == [0.5, 0.0, 0.25]


def test_the_tool_on_the_cpu_backend_reports_exact_agreement(tmp_path, capsys, monkeypatch):
    from deepinfer_core.quant.writer import QuantRecipe, quantize_checkpoint

    monkeypatch.setenv(quant_accuracy.FP8_TC_VARIABLE, "1")  # the tool sets it for each run; restored after

    folder = tmp_path / "tiny_fp4"
    quantize_checkpoint(REPO / "deepinfer_core" / "assets" / "tiny_v4", folder, QuantRecipe("fp4", "fp8", 128))
    assert quant_accuracy.main(["--model", str(folder), "--backend", "cpu", "--dtype", "float32", "--num-prompts", "3",
                                "--input-len", "20", "--output-len", "6"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "greedy agreement 1.000 (18 of 18 tokens" in lines[1]
    assert "3 of 3 completions identical" in lines[1]
    assert "largest |difference| 0.0000" in lines[2] and "(18 tokens)" in lines[2]
    assert lines[-1].startswith(f"| {folder} | float32, 3 x 20 in / 6 out | 1.000 | 3 / 3 | 0.0000 |")

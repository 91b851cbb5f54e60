"""Shared fixtures: a tiny random Llama and the embedded SmolLM2."""

from __future__ import annotations

import os

import pytest

# The Triton kernels run in Triton's interpreter on CPU; it must be chosen before they are defined.
os.environ.setdefault("TRITON_INTERPRET", "1")
from support import tiny_llama


@pytest.fixture(scope="session")
def llama():
    return tiny_llama()


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2 (model, tokenizer); `make test` converts it before the suite runs."""
    from jitney.core.models import load_model

    return load_model("smollm2")

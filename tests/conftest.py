"""Suite-wide fixtures: the attention backend chosen by nox (PAGED_TEST_BACKEND)."""

from __future__ import annotations

import os

import pytest

# dtype "auto" is bf16 on CPUs with AMX / AVX512-BF16; the suite's tolerances
# are float32's, so it runs float32 on every machine (subprocesses inherit it).
os.environ.setdefault("PAGED_CPU_BF16", "0")
# Compiling the forward pass costs seconds per engine; the suite builds
# hundreds. tests/server/engine/test_compiled_forward.py turns it back on.
os.environ.setdefault("PAGED_COMPILE", "0")


@pytest.fixture
def attention_backend() -> str:
    """`ref` or `triton`; tests that use it should carry `@pytest.mark.backend`."""
    return os.environ.get("PAGED_TEST_BACKEND", "ref")

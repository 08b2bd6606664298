"""Suite-wide fixtures: the attention backend chosen by nox (PAGED_TEST_BACKEND)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def attention_backend() -> str:
    """`ref` or `triton`; tests that use it should carry `@pytest.mark.backend`."""
    return os.environ.get("PAGED_TEST_BACKEND", "ref")

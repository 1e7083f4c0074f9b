"""Fixtures for router tests: a tiny tokenizer on disk and the token script fakes play."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.model.tokenizer import Tokenizer
from tests.router.harness import write_tiny_tokenizer

OUTPUT_TEXT = "Hi there! How are you?"


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_tokenizer(tmp_path_factory.mktemp("router_tok"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer(tokenizer_dir)


@pytest.fixture(scope="session")
def script(tokenizer: Tokenizer) -> list[int]:
    """What every fake worker generates: OUTPUT_TEXT (one token per byte), then EOS."""
    return tokenizer.encode(OUTPUT_TEXT) + [tokenizer.eos_token_ids[0]]

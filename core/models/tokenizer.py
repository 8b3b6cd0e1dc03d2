"""Tokenizers for ``pagedkv generate``: bytes for the built-in models, else the model's."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from pagedkv.models.errors import ModelSupportError


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (the built-in tiny models' vocabulary)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A model directory's own tokenizer (transformers' AutoTokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=False))


def load_tokenizer(path: str | Path) -> Tokenizer:
    from transformers import AutoTokenizer

    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(str(path), local_files_only=True))
    except (OSError, ValueError) as exc:
        raise ModelSupportError(
            f"{path}: no tokenizer could be loaded ({exc}); give prompts as token ids"
        ) from None

"""Request traces for the simulator: a synthetic ShareGPT-like one, or CSV / JSONL files."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pagedkv.errors import TraceFormatError

# Mean prompt and output lengths of the ShareGPT trace in the PagedAttention paper
# (Kwon et al., SOSP 2023, Fig. 11a), the target of the synthetic trace.
SHAREGPT_MEAN_PROMPT = 161.31
SHAREGPT_MEAN_OUTPUT = 337.99
# Log-space spread of the synthetic lengths: an assumption giving ShareGPT's long
# tail (a few prompts and answers near the length limit), not a fitted value.
SHAREGPT_SIGMA_PROMPT = 1.0
SHAREGPT_SIGMA_OUTPUT = 0.8

PROMPT_KEYS = ("prompt_len", "input_len", "prompt_tokens", "num_prompt_tokens")
OUTPUT_KEYS = ("output_len", "output_tokens", "num_output_tokens", "completion_tokens")


@dataclass(frozen=True)
class TraceRequest:
    prompt_len: int
    output_len: int

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


def sharegpt_like(
    num_requests: int, *, max_model_len: int = 2048, seed: int = 0
) -> list[TraceRequest]:
    """Lognormal prompt and output lengths with ShareGPT's means (before clipping).

    Each request is clipped to max_model_len tokens in all (the output is cut), as
    a server with that limit would.
    """
    if num_requests <= 0 or max_model_len < 2:
        raise TraceFormatError(
            f"need num_requests > 0 and max_model_len >= 2, got {num_requests}, {max_model_len}"
        )
    rng = np.random.default_rng(seed)

    def lognormal(mean: float, sigma: float) -> np.ndarray:
        return rng.lognormal(math.log(mean) - sigma**2 / 2, sigma, num_requests)

    prompts = np.clip(
        np.rint(lognormal(SHAREGPT_MEAN_PROMPT, SHAREGPT_SIGMA_PROMPT)), 1, max_model_len - 1
    )
    outputs = np.clip(np.rint(lognormal(SHAREGPT_MEAN_OUTPUT, SHAREGPT_SIGMA_OUTPUT)), 1, None)
    outputs = np.minimum(outputs, max_model_len - prompts)
    return [TraceRequest(int(p), int(o)) for p, o in zip(prompts, outputs, strict=True)]


def load_trace(path: str | Path, *, max_model_len: int | None = None) -> list[TraceRequest]:
    """Read a CSV (with a header row) or JSONL file of prompt/output lengths.

    Accepted column names: prompt_len / input_len / prompt_tokens, and output_len /
    output_tokens / completion_tokens. Requests longer than max_model_len are
    rejected with the line number.
    """
    path = Path(path)
    if not path.is_file():
        raise TraceFormatError(f"trace file {str(path)!r} does not exist")
    with path.open(newline="") as f:
        if path.suffix.lower() in (".jsonl", ".json", ".ndjson"):
            rows = _jsonl_rows(path, f)
        else:
            rows = ((i + 2, row) for i, row in enumerate(csv.DictReader(f)))
        out = [_parse_row(path, line, row, max_model_len) for line, row in rows]
    if not out:
        raise TraceFormatError(f"trace file {str(path)!r} holds no requests")
    return out


def _jsonl_rows(path: Path, lines: Iterable[str]) -> Iterable[tuple[int, Mapping]]:
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise TraceFormatError(f"{path}:{number}: expected a JSON object per line")
        yield number, row


def _parse_row(path: Path, line: int, row: Mapping, max_model_len: int | None) -> TraceRequest:
    prompt = _field(path, line, row, PROMPT_KEYS, minimum=1)
    output = _field(path, line, row, OUTPUT_KEYS, minimum=1)
    if max_model_len is not None and prompt + output > max_model_len:
        raise TraceFormatError(
            f"{path}:{line}: prompt {prompt} + output {output} tokens exceed "
            f"max_model_len {max_model_len}"
        )
    return TraceRequest(prompt, output)


def _field(path: Path, line: int, row: Mapping, keys: tuple[str, ...], minimum: int) -> int:
    key = next((k for k in keys if k in row and row[k] not in (None, "")), None)
    if key is None:
        raise TraceFormatError(f"{path}:{line}: missing a column named one of {', '.join(keys)}")
    raw = row[key]
    try:
        value = int(raw)
        if isinstance(raw, float | str) and float(raw) != value:
            raise ValueError
    except (TypeError, ValueError):
        raise TraceFormatError(f"{path}:{line}: {key} = {raw!r} is not an integer") from None
    if value < minimum:
        raise TraceFormatError(f"{path}:{line}: {key} = {value}, expected >= {minimum}")
    return value

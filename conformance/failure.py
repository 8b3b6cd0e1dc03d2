"""How a failure is told: a sentence plus the facts it names as fields, and where an
exception came from."""

from __future__ import annotations

import sysconfig
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Failure:
    """One reason a scenario failed: a sentence, and the facts it names as fields
    (request, token, position, head, ... ; JSON-ready) for the report."""

    check: str  # "raised", "kv-cache-shape", "output-shape", "output-dtype",
    # "non-finite-output", "output" or "cache"
    message: str
    fields: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message

    def to_json(self) -> dict[str, Any]:
        return {"check": self.check, "message": self.message, **self.fields}


# frames inside these packages are the libraries a kernel calls, not the kernel
_LIBRARIES = {"torch", "triton", "jax", "jaxlib", "numpy"}
_STDLIB = {Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib")}


def describe_exception(exc: BaseException) -> str:
    """``Type: message (at file:line)``, located at the deepest frame of the code under
    test: frames in the standard library (importlib, say) and in torch, triton, jax
    and numpy are passed over; the deepest frame follows when it is elsewhere."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    if isinstance(exc, SyntaxError) and exc.filename:  # the broken file is not a frame
        return f"{type(exc).__name__}: {exc.msg} (at {exc.filename}:{exc.lineno})"
    own = [f for f in frames if not _is_library(f.filename)]
    where = ""
    if own:
        where = f" (at {own[-1].filename}:{own[-1].lineno}"
        if frames[-1] is not own[-1]:
            where += f"; raised in {frames[-1].filename}:{frames[-1].lineno}"
        where += ")"
    elif frames:
        where = f" (at {frames[-1].filename}:{frames[-1].lineno})"
    return f"{type(exc).__name__}: {exc}{where}"


def _is_library(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return True
    parts = Path(filename).parts
    for i, part in enumerate(parts[:-1]):
        if part in ("site-packages", "dist-packages"):  # installed code, a plugin's too
            return parts[i + 1] in _LIBRARIES
    return any(parent in _STDLIB for parent in Path(filename).resolve().parents)

"""Models by name: the built-in tiny configs (random weights, no download) or a local
Hugging Face model directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from pagedkv.models.deps import require_transformers
from pagedkv.models.errors import ModelSupportError
from pagedkv.models.hf import HFModel
from pagedkv.serving import TensorParallel

CONFIG_DIR = Path(__file__).parent / "configs"


def builtin_names() -> list[str]:
    """The tiny configs shipped with pagedkv (``tiny-llama``, ``tiny-deepseek-v3``, ...)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def builtin_config(name: str) -> Any:
    """The transformers config of a built-in tiny model."""
    transformers = require_transformers()
    path = CONFIG_DIR / f"{name}.json"
    if not path.is_file():
        raise ModelSupportError(
            f"unknown built-in model {name!r}; built-in: {', '.join(builtin_names())}"
        )
    values = json.loads(path.read_text())
    return transformers.AutoConfig.for_model(values.pop("model_type"), **values)


def random_model(config: Any, *, dtype: torch.dtype, device: str, seed: int) -> Any:
    """A transformers causal LM from ``config`` with seeded random weights (the global
    RNG is left as it was)."""
    transformers = require_transformers()
    target = torch.device(device)
    cuda = [target.index or 0] if target.type == "cuda" else []
    # the weights are drawn where they will live: an 8B model's random init takes
    # seconds on a GPU and a minute on CPU cores
    with torch.random.fork_rng(devices=cuda), target:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(target)


def model_directory(name_or_path: str) -> Path | None:
    """The local model directory ``name_or_path`` names, None for a built-in model;
    raises ModelSupportError when it is neither."""
    if name_or_path in builtin_names():
        return None
    path = Path(name_or_path)
    if not path.is_dir():
        raise ModelSupportError(
            f"--model {name_or_path!r} is neither a built-in model "
            f"({', '.join(builtin_names())}) nor a local model directory"
        )
    return path


def load_model(
    name_or_path: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    tp: TensorParallel | None = None,
    compile: str | None = None,
) -> HFModel:
    """A built-in tiny model (random weights from ``seed``) or a local model directory
    (its weights; nothing is downloaded). ``tp``: this rank's shard of it;
    ``compile``: a torch.compile backend for its forward (``HFModel``)."""
    transformers = require_transformers()
    path = model_directory(name_or_path)
    if path is None:
        model = random_model(builtin_config(name_or_path), dtype=dtype, device=device, seed=seed)
        return HFModel(model, tp=tp, compile=compile)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, local_files_only=True
        )
    except (OSError, ValueError) as exc:
        raise ModelSupportError(f"{path}: could not load a causal LM ({exc})") from None
    return HFModel(model.to(device), tp=tp, compile=compile)

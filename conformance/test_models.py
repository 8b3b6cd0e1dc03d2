"""Model-level conformance (``--conformance-models``): tiny random-weight Hugging Face
models through each ``--backend`` and pagedkv's serving layer, against transformers.
See ``pagedkv/conformance/models.py`` and docs/serving.md.

Imports are absolute (``pagedkv.conformance...``): pytest may import this file as
``conformance.test_models`` from a source tree.
"""

from __future__ import annotations

import pytest
import torch
from pagedkv.conformance.models import MODELS, run_model_check

CASE = "model_case"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if CASE not in metafunc.fixturenames:
        return
    config = metafunc.config
    if not config.getoption("pagedkv_models"):
        off = pytest.mark.skip(reason="model-level conformance runs with --conformance-models")
        metafunc.parametrize(CASE, [pytest.param(None, id="models-off", marks=off)])
        return
    backends = config.getoption("pagedkv_backends") or ["torch"]
    if "all" in backends:
        from pagedkv.registry import list_backends

        backends = [r.name for r in list_backends()]
    metafunc.parametrize(
        CASE,
        [pytest.param((b, m), id=f"{b}:{m}") for b in dict.fromkeys(backends) for m in MODELS],
    )


def test_model(model_case: tuple[str, str], request: pytest.FixtureRequest) -> None:
    """Greedy tokens and logits of the served model equal transformers' own."""
    pytest.importorskip("transformers", reason="needs pagedkv[models] (transformers)")
    backend, model = model_case
    device = request.config.getoption("pagedkv_device") or (
        "cuda" if torch.cuda.is_available() else "cpu"
    )
    # float32 on a CPU (exact comparisons); GPU kernels run 16-bit models
    dtype = torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    threads = torch.get_num_threads()
    if dtype == torch.float32:
        # tiny tensors: intra-op threads only add synchronisation (and stall on busy cores)
        torch.set_num_threads(1)
    try:
        result = run_model_check(model, backend, device, dtype)
    finally:
        torch.set_num_threads(threads)
    print(result.report())
    if result.skipped:
        pytest.skip(result.skipped)
    if not result.passed:
        pytest.fail(result.report(), pytrace=False)

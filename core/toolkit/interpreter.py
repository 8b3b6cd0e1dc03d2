"""The one check for Triton's CPU interpreter (``TRITON_INTERPRET``).

Triton decides per kernel, when ``@triton.jit`` decorates it, whether it runs compiled
or interpreted, from the ``TRITON_INTERPRET`` environment variable. Setting the
variable after a kernel module was imported changes nothing for that module, so the
answer comes from a kernel once one is loaded, and from the environment (parsed by
Triton's own rule) before.
"""

from __future__ import annotations

import os
import sys

ENV = "TRITON_INTERPRET"
_TRUE = ("1", "true", "yes", "on", "y")  # Triton's getenv_bool
_PROBE_MODULE = "pagedkv.toolkit.triton_kv_write"


def interpreting() -> bool:
    """Whether pagedkv's Triton kernels run (or will run) in Triton's interpreter."""
    module = sys.modules.get(_PROBE_MODULE)
    if module is not None:
        return type(module.write_kv_kernel).__name__ == "InterpretedFunction"
    return os.environ.get(ENV, "").strip().lower() in _TRUE


def interpreter_problem(device_type: str) -> str | None:
    """Why Triton kernels cannot run on ``device_type`` here, or None."""
    if device_type == "cpu" and not interpreting():
        return (
            f"device cpu needs Triton's interpreter: set {ENV}=1 before the kernels are first "
            "imported"
        )
    return None

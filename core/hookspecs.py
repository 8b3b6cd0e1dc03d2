"""Hook specifications of the "pagedkv" plugin system.

A plugin is any importable module (or object) exposed through the entry-point
group ``pagedkv`` that implements some of these hooks with ``@pagedkv.hookimpl``.
Our own backends register through that same group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from pagedkv.backend import AttentionBackend

PROJECT_NAME = "pagedkv"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

# -------------------------------------------------------------------------
# backends
# -------------------------------------------------------------------------


@hookspec
def pagedkv_backends() -> list[type[AttentionBackend]]:
    """Return the backend classes this plugin provides (one plugin may give several).

    Called once per process when the registry loads. Must be cheap: import the
    backend's kernel library lazily, not here.

    :return: AttentionBackend subclasses, each with a unique ``name``.
    """


# -------------------------------------------------------------------------
# conformance
# -------------------------------------------------------------------------


@hookspec
def pagedkv_conformance_scenarios(backend: AttentionBackend, level: str) -> list[Any]:
    """Return extra conformance scenarios to run against ``backend``.

    :param backend: the configured backend under test.
    :param level: "quick" or "full".
    :return: ``pagedkv.conformance.Scenario`` objects; the harness filters them by
        the backend's declared capabilities like its own.
    """

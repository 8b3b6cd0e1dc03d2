"""pytest plugin of the conformance harness (filled in by the harness issue)."""

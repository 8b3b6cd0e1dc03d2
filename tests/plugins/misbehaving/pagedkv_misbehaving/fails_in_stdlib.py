"""Fails at import inside the standard library, called from this file's line 7."""

import json

import pagedkv  # noqa: F401

SETTINGS = json.loads("{not json")

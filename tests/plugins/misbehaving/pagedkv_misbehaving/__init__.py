"""One module per mistake; see pyproject.toml for the entry points."""

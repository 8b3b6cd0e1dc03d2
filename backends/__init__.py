"""The backends shipped with pagedkv. Each registers through the ``pagedkv``
entry-point group, exactly as a third-party plugin does."""

import pagedkv


@pagedkv.hookimpl
def pagedkv_backends():
    raise RuntimeError("vendor runtime not initialised")

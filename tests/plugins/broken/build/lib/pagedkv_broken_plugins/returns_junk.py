import pagedkv


@pagedkv.hookimpl
def pagedkv_backends():
    return ["not a backend class"]

import pagedkv_kernel_library_that_does_not_exist  # noqa: F401

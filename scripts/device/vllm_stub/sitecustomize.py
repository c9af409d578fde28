import ct_stub  # noqa: F401

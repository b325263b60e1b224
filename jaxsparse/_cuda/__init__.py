"""cuSPARSELt (2:4 sparse tensor cores) behind :mod:`jaxsparse.ops`: XLA FFI custom calls built on first use."""

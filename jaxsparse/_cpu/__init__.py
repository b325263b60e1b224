"""C++ CPU kernels (XLA FFI custom calls) behind :mod:`jaxsparse.ops`, built on first use."""

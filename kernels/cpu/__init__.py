"""The C backend for CPUs (float32 activations; float32 or fp8 e4m3 KV cache).

  paged_attention.c, layer_ops.c, token_bitmask.c, vec.h   the C sources
  library.py       builds them at first use into one shared library (cached per source,
                   compiler and CPU) and loads it through ctypes
  attention.py     paged attention and the cache write, and this backend's KV cache layout
  layer_ops.py     the fused layer ops (residual + RMSNorm, rotary, SiLU-and-mul)
  token_bitmask.py grammar token bitmasks applied to logits (the sampler's, not the model's)

:func:`prefixserve.kernels.backends.select_backend` assembles the backend from these modules.
"""

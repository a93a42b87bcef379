"""The Triton backend for CUDA devices (fp16, bf16, fp32 activations; any of them or fp8 e4m3 KV).

  paged_attention.py  paged attention (varlen, GQA, sliding window, fp8 KV, split-KV decode)
  cache_write.py      the KV cache write (fp8 quantization with scales)
  layer_ops.py        the fused layer ops (residual + RMSNorm, rotary + cache write, SiLU-and-mul)

Every module imports triton: only :func:`prefixserve.kernels.backends.select_backend` reaches them, lazily,
so CPU-only installs never need a working Triton. On a CPU they run under ``TRITON_INTERPRET=1``.
"""

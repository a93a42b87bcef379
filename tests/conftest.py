"""Shared test setup.

TRITON_INTERPRET must be set before any ``@triton.jit`` decorator runs, i.e. before
a kernel module is imported: the interpreter runs the Triton kernels on CPU tensors.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

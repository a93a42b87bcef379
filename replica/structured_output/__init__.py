"""Structured output: grammar-constrained decoding (params, backend, compile pool, bitmasks)."""

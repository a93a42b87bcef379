"""Utilities every layer uses: strict config parsing, logging, tracing, graceful shutdown, cache paths.

Imports nothing from router/, replica/, kernels/ or loadtest/: it sits below all of them.
"""

"""Command-line tools over router inputs: the prefix-cache audit of a prompt log."""

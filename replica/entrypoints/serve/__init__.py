"""The Ray Serve deployment that hosts one engine."""

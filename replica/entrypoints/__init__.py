"""The ways into one engine: the offline ``LLM``, the OpenAI HTTP server, the Ray Serve deployment."""

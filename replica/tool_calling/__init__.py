"""Tool calling: chat templates that render tools, tool-call parsers, and the streamed tool-call deltas."""

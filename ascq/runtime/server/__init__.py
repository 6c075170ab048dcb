"""`ascq serve`: the OpenAI-compatible HTTP server on the runtime engine (see docs/ARCHITECTURE.md)."""

"""The engine: requests in, outputs out (LLMEngine), its process (EngineCore), arguments, the offline LLM
API, output processing and detokenization."""

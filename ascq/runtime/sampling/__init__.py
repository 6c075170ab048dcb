"""What a request asks of sampling: SamplingParams and structured outputs (the grammar engine)."""

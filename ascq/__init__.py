"""ascq: quantize Hugging Face LLM checkpoints into a model zoo and serve them."""

__version__ = "0.1.0"

"""Plain-PyTorch reference models, and the one table of supported model families."""

# config.json `model_type` -> the Hugging Face class-name prefix (`{prefix}ForCausalLM` in `architectures`);
# the converter (quantize/architectures.py) and the runtime (runtime/models/__init__.py) both read it.
MODEL_TYPES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "deepseek": "Deepseek"}
LLAMA_FAMILY = ("llama", "mistral", "qwen2")

"""One module per model family (its config facts, tensor layout, converter mappings, and the lazy paths of its
reference and serving classes) and the registry of families by config.json `model_type` (`registry.py`)."""

"""Frozen configurations every layer reads: the model's shape (model_config) and speculative decoding's settings."""

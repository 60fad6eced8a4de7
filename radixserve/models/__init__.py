"""Model definitions and loaders: the Llama family from Hugging Face folders and GGUF files."""

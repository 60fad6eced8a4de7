"""Reading checkpoints: a model folder's config and files, GGUF files turned into a Hugging Face folder, GGUF
block dequantization. Below `models/` (which builds the modules) and `lora/` (which reads GGUF adapters)."""

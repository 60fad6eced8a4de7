"""Multi-LoRA serving: PEFT adapters (adapter.py), their products in a mixed batch (layers.py), and the
adapters of one model runner (manager.py). docs/lora.md describes the whole."""

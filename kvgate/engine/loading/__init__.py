"""What a model is made of and where it comes from: model configs, checkpoints (Hugging
Face folders, GGUF files, Hub ids, wheels), LoRA adapters and the tiny test model."""

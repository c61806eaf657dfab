"""GGUF files (llama.cpp, Ollama, LM Studio) loaded directly: metadata -> `ModelConfig`
(`metadata`), vocabulary -> `Tokenizer` (`vocab`), tensors dequantized at load into the
engine's parameters (`tensors`), all three put together by `loader.load_gguf`."""

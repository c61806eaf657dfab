"""Text to tokens and back: the tokenizer and chat templates."""

"""The OpenAI-compatible front door (``/v1/*``, ``/tokenize``, ``/detokenize``)."""

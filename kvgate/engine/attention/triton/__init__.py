"""Triton kernels for the paged KV cache (GPU; CPU only under ``TRITON_INTERPRET=1``).

Importing this package imports Triton: only the Triton attention backend does so, lazily.
Each kernel's PyTorch reference lives in ``kvgate.engine.attention.torch_backend``.
"""

"""Triton kernels run on the CPU through the interpreter: switch it on before Triton loads.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, i.e. when ``kvgate.engine.attention.triton`` is
first imported, which only the kernel tests (below this folder) and the Triton backend do.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

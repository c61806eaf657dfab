"""Shared pytest setup: keep torch to the two cores CI has, deterministically."""

import torch

from engine.attention import cpu
from engine.models import gemm, quantized_linear

torch.set_num_threads(2)
# The native CPU kernels are built (or loaded) once, here: a server a test starts then loads
# the build at once instead of waiting for it within its start-up timeout.
cpu.load()
cpu.load_prefill()
gemm.load()
quantized_linear.load()


# Triton's nanobind bindings print "leaked instance" notices at interpreter exit, after pytest's
# summary; a run that imported Triton therefore ends here, once pytest is done with everything,
# so the summary stays the closing line of the README's test command.
_exit_status = 0


def pytest_sessionfinish(session, exitstatus):  # type: ignore[no-untyped-def]
    global _exit_status
    _exit_status = int(exitstatus)


def pytest_unconfigure(config):  # type: ignore[no-untyped-def]
    import os
    import sys

    if "triton" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status)

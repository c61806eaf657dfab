"""Shared pytest setup: keep torch to the two cores CI has, deterministically."""

import torch

import kvgate.engine.native as native

torch.set_num_threads(2)
# The native CPU library is loaded once, here (and, with KVGATE_BUILD_KERNELS=1 where none is
# installed, built): a server a test starts then finds it at once.
native.library()


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

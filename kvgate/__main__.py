"""``python -m kvgate`` is ``kvgate``."""

from kvgate.gateway.cli import main

main()

"""``python -m gateway`` is ``kvgate``."""

from gateway.cli import main

main()

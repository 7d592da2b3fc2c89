"""``python -m mariana.platform.cli ...`` (what torchrun workers run)."""

from .main import run

run()

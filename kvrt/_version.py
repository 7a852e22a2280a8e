"""This kvrt release's version (PEP 440), which peers name to each other at hello."""

from typing import Final

__version__: Final = "0.3.0.dev0"

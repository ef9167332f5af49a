"""The command line: click only, one module per command group.

``app`` holds the root group and the split-side commands; ``sync``, ``train``, ``report`` and
``wan`` are imported on first use (``app.LAZY_COMMANDS``), so ``geoshard split`` loads none of them.
"""

from geoshard.cli.app import main

__all__ = ["main"]

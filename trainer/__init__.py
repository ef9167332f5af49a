"""geoshard.trainer: the minimal DDP trainer and its IO-wait report.

Installed from the top-level ``trainer/`` folder as ``geoshard.trainer``. The training loop
arrives with the trainer issue; it will import ``geoshard.loaders``, never the split or sync code.
"""

__all__: list[str] = []

"""How a rank process ends: without the interpreter's finalization.

A gloo worker thread drops its last collective's work (and the tensors in it) a moment after the
main thread has been told that the collective finished. If the interpreter is finalizing by then,
the thread's GIL acquire for the tensors' Python objects unwinds it, and the process aborts with
SIGABRT ("terminate called without an active exception"; pytorch/pytorch#179291). DDP keeps the
process group alive past ``destroy_process_group``, so its threads outlive ``main`` too. Caught in
CI: a rank that had done all its work exited -6, and torchrun would count that as a failure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn


def exit_rank(code: int) -> NoReturn:
    """Flush what Python buffers, then leave at once with ``code``."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more to say on it
            stream.flush()
    os._exit(code)

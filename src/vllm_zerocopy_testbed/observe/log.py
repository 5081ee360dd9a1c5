"""The testbed's own log lines (modes, ranks, wire sends), visible in every vLLM process."""

from __future__ import annotations

import logging
import sys


def testbed_logger() -> logging.Logger:
    """Return a logger that writes to stderr whether or not vLLM configured logging yet.

    Plugins load before some processes configure vLLM's handlers, and vLLM's
    handlers cover its own namespace only; the mode line must show in every
    process, so it has a handler of its own.
    """
    log = logging.getLogger("vllm_zerocopy_testbed.modes")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("INFO %(asctime)s [testbed] %(message)s", "%m-%d %H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log

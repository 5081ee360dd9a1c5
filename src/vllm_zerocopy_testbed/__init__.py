"""Integration testbed for vLLM's zero-copy transport paths.

Two paths are under test, each switchable per process between ``upstream``
(installed vLLM as is), ``off`` (the pre-fix behaviour) and ``testbed`` (ours):

* tensor broadcast through ``MessageQueue.enqueue`` (``patches.broadcast``);
* detaching Ray compiled-graph outputs from channel memory (``patches.detach``).
"""

__version__ = "0.1.0"

"""Leftovers in /dev/shm: vLLM leaves ``psm_*``, ``*-cpushm*`` and ``sem.*`` on SIGTERM."""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
# Names vLLM, torch and Ray leave behind when their processes are killed.
LEAK_PATTERNS = ("psm_*", "*cpushm*", "sem.*", "torch_*", "vllm*")


def _names() -> frozenset[str]:
    try:
        return frozenset(p.name for p in SHM_DIR.iterdir())
    except OSError:
        return frozenset()


@dataclass(frozen=True)
class ShmSnapshot:
    """The /dev/shm entries present before we started something."""

    before: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def take(cls) -> "ShmSnapshot":
        return cls(_names())

    def new_leaks(self) -> list[str]:
        """Return entries matching a leak pattern that appeared since the snapshot."""
        return sorted(
            name
            for name in _names() - self.before
            if any(fnmatch.fnmatch(name, pattern) for pattern in LEAK_PATTERNS)
        )

    def remove_new(self) -> list[str]:
        """Remove the leaks that appeared since the snapshot; return their names."""
        removed = []
        for name in self.new_leaks():
            try:
                (SHM_DIR / name).unlink()
                removed.append(name)
            except FileNotFoundError:
                pass  # its owner removed it between the listing and here: nothing left
            except OSError as exc:
                logger.warning("could not remove /dev/shm/%s: %s", name, exc)
        if removed:
            logger.info("removed %d leftover /dev/shm entries: %s", len(removed), removed[:5])
        return removed

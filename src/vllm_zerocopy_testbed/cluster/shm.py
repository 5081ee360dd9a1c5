"""Leftovers in /dev/shm: vLLM leaves ``psm_*``, ``*-cpushm*`` and ``sem.*`` on SIGTERM; and in the
temp directory, the ``vllm_dist_*`` file stores of its multiprocessing executor's rendezvous."""

from __future__ import annotations

import fnmatch
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
# Names vLLM, torch and Ray leave behind when their processes are killed.
LEAK_PATTERNS = ("psm_*", "*cpushm*", "sem.*", "torch_*", "vllm*")
# vLLM's multiprocessing executor meets its workers in a torch FileStore at
# <tempdir>/vllm_dist_<uuid> (vllm.utils.network_utils.get_file_store_init_method); a server that
# is stopped leaves it behind (one per host server, five per `make e2e`): ApiServerProcess removes it.
FILE_STORE_PATTERNS = ("vllm_dist_*",)


def _names(directory: Path) -> frozenset[str]:
    try:
        return frozenset(p.name for p in directory.iterdir())
    except OSError:
        return frozenset()


@dataclass(frozen=True)
class ShmSnapshot:
    """The entries of ``directory`` (/dev/shm unless named) present before we started something."""

    before: frozenset[str] = field(default_factory=frozenset)
    directory: Path = SHM_DIR
    patterns: tuple[str, ...] = LEAK_PATTERNS

    @classmethod
    def take(cls, directory: Path = SHM_DIR, patterns: tuple[str, ...] = LEAK_PATTERNS) -> "ShmSnapshot":
        return cls(_names(directory), directory, patterns)

    @classmethod
    def file_stores(cls) -> "ShmSnapshot":
        """The temp directory's vLLM file stores (``vllm_dist_*``) present now."""
        return cls.take(Path(tempfile.gettempdir()), FILE_STORE_PATTERNS)

    def new_leaks(self) -> list[str]:
        """Return entries matching a leak pattern that appeared since the snapshot."""
        return sorted(
            name
            for name in _names(self.directory) - self.before
            if any(fnmatch.fnmatch(name, pattern) for pattern in self.patterns)
        )

    def paths(self) -> list[str]:
        """The new leaks as paths."""
        return [str(self.directory / name) for name in self.new_leaks()]

    def remove_new(self) -> list[str]:
        """Remove the leaks that appeared since the snapshot; return their names."""
        removed = []
        for name in self.new_leaks():
            try:
                (self.directory / name).unlink()
                removed.append(name)
            except FileNotFoundError:
                pass  # its owner removed it between the listing and here: nothing left
            except OSError as exc:
                logger.warning("could not remove %s: %s", self.directory / name, exc)
        if removed:
            logger.info("removed %d leftover %s entries: %s", len(removed), self.directory, removed[:5])
        return removed

"""Leftovers in /dev/shm: vLLM leaves ``psm_*``, ``*-cpushm*`` and ``sem.*`` on SIGTERM, Ray's compiled
graphs their channel semaphores, torch its ``torch_*`` segments.

A run removes only what its own processes made (two runs may share one machine). The names say
nothing of their maker, and a file outlives the process that made it, so ownership is recorded while
the processes live: every process a run starts carries ``TESTBED_OWNER=<token>`` in its environment
(inherited by what it spawns: vLLM's workers, Ray's), and ``ShmClaim.record`` adds the entries those
processes map or hold open (``/proc/<pid>/maps``, ``/proc/<pid>/fd``). ``watch`` records every
``interval`` seconds in a thread, so a process that dies mid-run has had its files recorded; the
owners record once more right before they signal their processes. Ray's compiled-graph channels name
their semaphores after the process that made them (``sem.hdr<pid>-<n>``, ``sem.obj<pid>-<n>``) and do
not keep every one mapped (measured: a deadlocked graph left 6 a run that no reading saw mapped): such
a name is ours when its PID was one of our processes'. An entry that was there before the claim is
never ours. What another run made, held or not, is left alone.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
# Names vLLM, torch and Ray leave behind when their processes are killed.
LEAK_PATTERNS = ("psm_*", "*cpushm*", "sem.*", "torch_*", "vllm*")
OWNER_ENV = "TESTBED_OWNER"
# Ray's mutable-object channels: sem.hdr<pid>-<n> / sem.obj<pid>-<n>, <pid> the process that made it.
MAKER_PID = re.compile(r"sem\.(?:hdr|obj)(\d+)-")


def _names(directory: Path) -> frozenset[str]:
    try:
        return frozenset(p.name for p in directory.iterdir())
    except OSError:
        return frozenset()


def owner_pids(token: str, variable: str = OWNER_ENV) -> list[int]:
    """Every live process whose environment (as it was exec'd; a fork shares its parent's) says
    ``TESTBED_OWNER=<token>`` (or ``variable=<token>``)."""
    marker = f"{variable}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, a zombie, or not ours to read
            continue
    return sorted(found)


def held(pids: Iterable[int], directory: Path = SHM_DIR) -> set[str]:
    """The names of ``directory``'s entries that ``pids`` map or hold open now."""
    prefix = f"{directory}/"
    names: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", "rb") as maps:
                for line in maps:
                    at = line.find(prefix.encode())
                    if at >= 0:
                        names.add(line[at + len(prefix):].decode(errors="replace").split()[0])
        except OSError:
            pass
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                names.add(target[len(prefix):].split()[0])
    return names


@dataclass
class ShmClaim:
    """What one run's processes made in ``directory`` (/dev/shm unless named): give them ``env``, keep
    ``record``-ing (or ``watch``), then ``remove_new`` once they are gone."""

    before: frozenset[str] = field(default_factory=frozenset)
    directory: Path = SHM_DIR
    patterns: tuple[str, ...] = LEAK_PATTERNS
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    seen: set[str] = field(default_factory=set)
    pids: set[int] = field(default_factory=set)  # every process of ours any reading met

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def take(cls, directory: Path = SHM_DIR, patterns: tuple[str, ...] = LEAK_PATTERNS) -> "ShmClaim":
        """A claim with a token of its own, on what ``directory`` holds now."""
        return cls(_names(directory), directory, patterns)

    @property
    def env(self) -> dict[str, str]:
        """The environment that makes a process (and what it spawns) one of ours."""
        return {OWNER_ENV: self.token}

    def _ours(self, name: str) -> bool:
        return name not in self.before and any(fnmatch.fnmatch(name, p) for p in self.patterns)

    def record(self, pids: Iterable[int] = ()) -> set[str]:
        """Add what our processes (and ``pids``) hold now; return what this call added."""
        ours = {*owner_pids(self.token), *pids}
        found = {n for n in held(ours, self.directory) if self._ours(n)}
        with self._lock:
            self.pids |= ours
            added = found - self.seen
            self.seen |= added
        return added

    def watch(self, interval: float = 2.0) -> None:
        """Record every ``interval`` s in a daemon thread until ``stop_watching``."""
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval):
                self.record()

        self._thread = threading.Thread(target=loop, name=f"shm-claim-{self.token[:6]}", daemon=True)
        self._thread.start()

    def stop_watching(self) -> None:
        """Stop the thread (bounded: it is between two records or in one, ~ms)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def new_leaks(self) -> list[str]:
        """Entries our processes held, or named after themselves, that are still there."""
        with self._lock:
            seen, pids = set(self.seen), set(self.pids)
        present = _names(self.directory)
        named = {n for n in present if self._ours(n) and (m := MAKER_PID.match(n)) and int(m.group(1)) in pids}
        return sorted(name for name in present if name in seen or name in named)

    def paths(self) -> list[str]:
        """The leaks as paths."""
        return [str(self.directory / name) for name in self.new_leaks()]

    def remove_new(self) -> list[str]:
        """Remove what our processes made and left; return the names removed."""
        self.stop_watching()
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
            logger.info("removed %d leftover %s entries of ours: %s", len(removed), self.directory, removed[:5])
        return removed

"""One vLLM OpenAI API server started by us, as a process group: start, wait, pause, stop.

Shared by the local backend's head (``local_vllm.py``) and the single-process reference
(``reference.py``): the same start (its own session, output to a log file), the same
bounded wait for ``/health`` that ends early when the server exits, the same stop.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from vllm_zerocopy_testbed.cluster.interface import ClusterStartError
from vllm_zerocopy_testbed.cluster.process import pause_group, resume_group, stop_group
from vllm_zerocopy_testbed.cluster.shm import ShmSnapshot
from vllm_zerocopy_testbed.node.warmup import is_healthy
from vllm_zerocopy_testbed.waits import WaitAborted, WaitTimeout, wait_until

logger = logging.getLogger(__name__)


class ApiServerProcess:
    """``name``: how errors call it ("reference server", "API server"); its log is a temp file."""

    def __init__(self, name: str, log_prefix: str) -> None:
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = Path(tempfile.mkstemp(prefix=log_prefix, suffix=".log")[1])
        self._paused = False
        self._stores: ShmSnapshot | None = None  # taken at start: the file stores already there

    def start(self, argv: Sequence[str], env: Mapping[str, str]) -> None:
        self._stores = ShmSnapshot.file_stores()
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, env=dict(env),
                                         start_new_session=True)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, url: str, timeout: float, poll_s: float = 1.0) -> None:
        """Until ``url``/health answers, at most ``timeout`` s; ``ClusterStartError`` with the log tail
        if it does not, or at once when the server exits."""

        def exited() -> str | None:
            code = self.proc.poll() if self.proc is not None else "never started"
            return None if code is None else f"exited ({code})"

        try:
            wait_until(f"{self.name} {url}/health", lambda: is_healthy(url), timeout=timeout, poll_s=poll_s,
                       abort=exited, log_tail=lambda: self.logs(60), announce=logger.info)
        except (WaitAborted, WaitTimeout) as exc:
            raise ClusterStartError(str(exc)) from None

    def pause(self) -> None:
        """Stop the whole group (SIGSTOP): an idle vLLM server still polls."""
        self._paused = pause_group(self.proc)

    def resume(self) -> None:
        """Let a paused group run again (SIGCONT); nothing if it is not paused."""
        if self._paused:
            resume_group(self.proc)
        self._paused = False

    @contextlib.contextmanager
    def awake(self) -> Iterator[None]:
        """Run the server for the block; paused again after it if it was paused before."""
        was_paused = self._paused
        self.resume()
        try:
            yield
        finally:
            if was_paused:
                self.pause()

    def stop(self) -> None:
        """Stop the group (bounded: SIGTERM, a grace period, SIGKILL) and remove the file store its
        executor left (``vllm_dist_*``)."""
        self.resume()  # a stopped process acts on SIGTERM only once continued
        stop_group(self.proc)
        if self._stores is not None:
            self._stores.remove_new()

    def leftover(self) -> list[str]:
        running = [f"{self.name} pid {self.proc.pid} still running"] if self.running() else []
        return running + (self._stores.paths() if self._stores is not None else [])

    def logs(self, tail: int | None = None) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join(lines[-tail:] if tail else lines)

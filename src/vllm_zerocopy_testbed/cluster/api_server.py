"""One vLLM OpenAI API server started by us, as a process group: start, wait, pause, stop.

Shared by the local backend's head (``local_vllm.py``) and the single-process reference
(``reference.py``): the same start (its own session, output to a log file), the same
bounded wait for ``/health`` that ends early when the server exits, the same stop.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from vllm_zerocopy_testbed.cluster.interface import ClusterStartError
from vllm_zerocopy_testbed.cluster.process import pause_group, resume_group, stop_group
from vllm_zerocopy_testbed.cluster.shm import ShmClaim
from vllm_zerocopy_testbed.waits import WaitAborted, WaitTimeout, wait_until
from vllm_zerocopy_testbed.workload.warmup import is_healthy

logger = logging.getLogger(__name__)


def _compile_cache(env: Mapping[str, str]) -> str:
    """Torch's compile cache as the server would find it under the shared temp directory (torch's own
    default, ``<tmp>/torchinductor_<user>``): the server's own TMPDIR must not move it."""
    if env.get("TORCHINDUCTOR_CACHE_DIR"):
        return env["TORCHINDUCTOR_CACHE_DIR"]
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry: torch says uid_<n>
        user = f"uid_{os.getuid()}"
    return str(Path(tempfile.gettempdir()) / f"torchinductor_{user}")


class ApiServerProcess:
    """``name``: how errors call it ("reference server", "API server"); its log is a temp file."""

    def __init__(self, name: str, log_prefix: str) -> None:
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = Path(tempfile.mkstemp(prefix=log_prefix, suffix=".log")[1])
        self._paused = False
        self.shm: ShmClaim | None = None  # taken at start: what /dev/shm held before, and our token
        self.tmp: Path | None = None  # the server's own temp directory

    def start(self, argv: Sequence[str], env: Mapping[str, str]) -> None:
        """Start the server in a session of its own. Its processes carry our claim's token (what they
        leave in /dev/shm is ours to remove, nothing else) and a temp directory of their own: vLLM's
        multiprocessing rendezvous (``vllm_dist_*``), its IPC sockets and multiprocessing's ``pymp-*``
        go there and with it at ``stop``. Torch's compile cache stays where it was shared."""
        self.shm = ShmClaim.take()
        self.tmp = Path(tempfile.mkdtemp(prefix="tbs", dir="/tmp"))  # short: unix socket paths
        env = {**env, "TORCHINDUCTOR_CACHE_DIR": _compile_cache(env), "TMPDIR": str(self.tmp),
               "VLLM_RPC_BASE_PATH": str(self.tmp), **self.shm.env}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        self.shm.watch()

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
        """Stop the group (bounded: SIGTERM, a grace period, SIGKILL), then remove what it left in
        /dev/shm and its temp directory (the executor's file store ``vllm_dist_*`` among it)."""
        if self.shm is not None:
            self.shm.record()  # what it holds now: SIGKILL leaves it behind
        self.resume()  # a stopped process acts on SIGTERM only once continued
        stop_group(self.proc)
        if self.shm is not None:
            self.shm.remove_new()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def leftover(self) -> list[str]:
        running = [f"{self.name} pid {self.proc.pid} still running"] if self.running() else []
        tmp = [str(self.tmp)] if self.tmp is not None and self.tmp.exists() else []
        return running + (self.shm.paths() if self.shm is not None else []) + tmp

    def logs(self, tail: int | None = None) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join(lines[-tail:] if tail else lines)

"""A workload that keeps going while the cluster is hurt: clients streaming requests, and a
``/health`` watcher. Both run in threads beside a nemesis (``nemesis.run``) and end by
themselves (every wait bounded); their records and figures go to the checkers."""

from __future__ import annotations

import threading
import time

from vllm_zerocopy_testbed.workload.requests import CompletionSpec, Record
from vllm_zerocopy_testbed.workload.runner import Runner
from vllm_zerocopy_testbed.workload.warmup import is_healthy


class Stream:
    """``clients`` threads sending ``specs`` back to back (client i starts at spec i) until
    ``stop_at`` (epoch seconds); after a failed request a client waits ``retry_s`` (the
    server is gone: keep probing, not spinning). Records kept in ``records``, in end order."""

    def __init__(self, runner: Runner, specs: list[CompletionSpec], *, suite: str = "nemesis", clients: int = 2,
                 retry_s: float = 1.0) -> None:
        if not specs or clients < 1:
            raise ValueError("a stream needs at least one spec and one client")
        self.runner, self.specs, self.suite, self.retry_s = runner, specs, suite, retry_s
        self.stop_at = float("inf")
        self.records: list[Record] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True, name=f"stream-{i}")
                         for i in range(clients)]

    def _client(self, index: int) -> None:
        i = index
        while time.time() < self.stop_at:
            record = self.runner.run(self.suite, [self.specs[i % len(self.specs)]])[0]
            with self._lock:
                self.records.append(record)
            if not record.ok:
                time.sleep(self.retry_s)
            i += 1

    def start(self) -> "Stream":
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, at: float) -> None:
        """No request starts after ``at`` (epoch seconds); those in flight run to their own bound."""
        self.stop_at = at

    def join(self, timeout: float) -> bool:
        """Wait at most ``timeout`` s in all for the clients; whether every one ended."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)


class HealthWatch:
    """Polls ``url`` (a server's root; ``/health`` is appended) every ``poll_s``; remembers when it
    first stopped answering 200 (``first_unhealthy``, epoch seconds). A context manager."""

    def __init__(self, url: str, poll_s: float = 1.0) -> None:
        self.url = url.rstrip("/")
        self.poll_s = poll_s
        self.first_unhealthy: float | None = None
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True, name="health-watch")

    def _poll(self) -> None:
        while not self._stop.is_set():
            ok = is_healthy(self.url)
            self.polls += 1
            if not ok and self.first_unhealthy is None:
                self.first_unhealthy = time.time()
            self._stop.wait(self.poll_s)

    def unhealthy_after(self, at: float) -> float | None:
        """Seconds from ``at`` until ``/health`` first failed, or None if it never did."""
        return None if self.first_unhealthy is None else self.first_unhealthy - at

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

"""Run specs against one server, one after another, concurrently, or for a stretch of time."""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterable

import httpx
import openai

from vllm_zerocopy_testbed.workload.requests import CompletionSpec, History, Record, send

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _announced(profile: str, suite: str, what: str, records: list[Record]):
    """Progress lines around a run: what it sends, then how long it took and how many failed."""
    logger.info("%s %s: sending %s", profile, suite, what)
    start = time.monotonic()
    try:
        yield
    finally:
        failed = sum(not r.ok for r in records)
        logger.info("%s %s: %d answer(s) in %.0f s%s", profile, suite, len(records), time.monotonic() - start,
                    f", {failed} not ok" if failed else "")


@dataclass
class Runner:
    """Sends specs to ``base_url`` and records each answer in ``history`` under ``suite``/``profile``."""

    base_url: str
    model: str
    history: History
    profile: str
    timeout_s: float
    # Entered around this runner's own runs and each request it sends as the other half of a pair:
    # a paused reference server runs only for its own requests (``ReferenceServer.awake``).
    awake: Callable[[], ContextManager[object]] = field(default=contextlib.nullcontext)

    def _client(self, keep_alive: bool = True) -> openai.OpenAI:
        """An OpenAI client; without ``keep_alive``, a fresh connection per request (a server
        paused between requests may close an idle one as it resumes, under the request)."""
        http = None if keep_alive else httpx.Client(limits=httpx.Limits(max_keepalive_connections=0),
                                                    timeout=self.timeout_s)
        return openai.OpenAI(base_url=self.base_url, api_key="testbed", timeout=self.timeout_s, max_retries=0,
                             http_client=http)

    def run(self, suite: str, specs: Iterable[CompletionSpec], *, concurrency: int = 1,
            paired: "Runner | None" = None) -> list[Record]:
        """Send every spec (``concurrency`` at a time); return their records in spec order.

        ``paired`` (one at a time only): each spec goes to that server first, right before
        this one, and its latency is kept in the record (``reference_latency_s``), so that the
        two are measured under the same load. Its records go to the history under its profile.
        """
        client = self._client()
        specs = list(specs)
        if paired is not None and concurrency > 1:
            raise ValueError("paired runs send one request at a time")
        other = paired._client(keep_alive=False) if paired is not None else None

        def one(spec: CompletionSpec) -> Record:
            before = None
            if paired is not None:
                with paired.awake():
                    answer = send(other, paired.model, spec, suite=f"{suite}-paired", profile=paired.profile,
                                  timeout=paired.timeout_s)
                before = paired.history.add(answer)
            record = send(client, self.model, spec, suite=suite, profile=self.profile, timeout=self.timeout_s)
            if before is not None and before.ok:
                record.reference_latency_s = before.latency_s
            return self.history.add(record)

        records: list[Record] = []
        with self.awake(), _announced(self.profile, suite, f"{len(specs)} request(s), {max(1, concurrency)} at a time",
                                      records):
            if concurrency <= 1:
                for spec in specs:
                    records.append(one(spec))
                    if records[-1].status == "timeout":
                        break  # a hung server answers nothing after it; the checker reports the hang
            else:
                with ThreadPoolExecutor(max_workers=concurrency) as pool:
                    records.extend(pool.map(one, specs))
        return records

    def run_staggered(self, suite: str, specs: Iterable[CompletionSpec], *, clients: int, seconds: float,
                      max_pause_s: float = 0.4) -> list[Record]:
        """``clients`` threads take the next spec (cycling) after a seeded pause of up to ``max_pause_s``,
        until ``seconds`` have passed: arrivals spread out, so batches keep forming while others run."""
        client = self._client()
        order = itertools.cycle(list(specs))
        lock = threading.Lock()
        deadline = time.monotonic() + seconds
        records: list[Record] = []

        def loop(seed: int) -> None:
            pauses = random.Random(seed)
            while time.monotonic() + max_pause_s < deadline:
                time.sleep(pauses.uniform(0, max_pause_s))
                with lock:
                    spec = next(order)
                record = self.history.add(send(client, self.model, spec, suite=suite, profile=self.profile,
                                               timeout=self.timeout_s))
                with lock:
                    records.append(record)

        with _announced(self.profile, suite, f"for {seconds:.0f} s from {clients} clients", records):
            with ThreadPoolExecutor(max_workers=clients) as pool:
                list(pool.map(loop, range(clients)))
        return records

    def run_for(self, suite: str, specs: Iterable[CompletionSpec], seconds: float) -> list[Record]:
        """Cycle through ``specs`` one at a time until ``seconds`` have passed; return the records."""
        client = self._client()
        deadline = time.monotonic() + seconds
        records: list[Record] = []
        with _announced(self.profile, suite, f"one request at a time for {seconds:.0f} s", records):
            for spec in itertools.cycle(list(specs)):
                if time.monotonic() >= deadline:
                    break
                records.append(self.history.add(send(client, self.model, spec, suite=suite, profile=self.profile,
                                                     timeout=self.timeout_s)))
                if not records[-1].ok:
                    break
        return records

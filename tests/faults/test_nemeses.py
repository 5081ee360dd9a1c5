"""Nemeses during a stream of logprobs and prompt_embeds requests (``make faults``, compose only).

Per nemesis: answers before the fault; then two clients stream requests, the
fault hits, it is held ``nemesis.HOLD_S`` and healed; every request in flight
at the fault or sent within the bound after it must end (answer or error) within
``FAULT_BOUND_S`` of the later of its start and the fault. Then the cluster must
come back — by itself (restart policies, the head's watchdog), else ``make up``
(``ComposeCluster.up``) — and answer the same requests bit-exact as before.
Figures per nemesis go to ``reports/<run>/faults.{json,md}``.
"""

from __future__ import annotations

import threading
import time

import pytest
import requests

from vllm_zerocopy_testbed import nemesis as nemeses
from vllm_zerocopy_testbed.checker import bitexact, faults, timeouts
from vllm_zerocopy_testbed.cluster.compose import ComposeCluster
from e2e_suite import FAULTS, HISTORY, PROFILES, REQUEST_TIMEOUT_S, SIZES, LiveCluster, judge
from vllm_zerocopy_testbed.workload.catalog import logprobs_specs
from vllm_zerocopy_testbed.workload.embeds import token_ids
from vllm_zerocopy_testbed.workload.requests import CompletionSpec, Embeds, Record
from vllm_zerocopy_testbed.workload.runner import Runner

pytestmark = [pytest.mark.faults, pytest.mark.suite("nemesis"), pytest.mark.timeout(1500)]

FAULT_BOUND_S = 60.0  # the testbed's promise: every request ends within 60 s of a node loss
LEAD_S = 5.0  # requests in flight before the fault
SELF_RECOVERY_S = 420.0  # head restart + warm-up on one core is ~3 min


def _specs() -> list[CompletionSpec]:
    ids = tuple(token_ids(SIZES.out_of_band, seed=11))
    return [*logprobs_specs(max_tokens=8)[:2],
            CompletionSpec("embeds/oob", embeds=(Embeds(ids),), max_tokens=8, logprobs=5)]


class Stream:
    """Two clients sending specs back to back until ``stop_at`` (epoch seconds); records kept."""

    def __init__(self, runner: Runner, specs: list[CompletionSpec], clients: int = 2) -> None:
        self.runner, self.specs = runner, specs
        self.stop_at = float("inf")
        self.records: list[Record] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, index: int) -> None:
        i = index
        while time.time() < self.stop_at:
            spec = self.specs[i % len(self.specs)]
            record = self.runner.run("nemesis", [spec])[0]
            with self._lock:
                self.records.append(record)
            if not record.ok:
                time.sleep(1.0)  # the server is gone: keep probing, not spinning
            i += 1

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


class HealthWatch:
    """Polls ``/health`` every second; remembers when it first stopped answering 200."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.first_unhealthy: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                ok = requests.get(self.url, timeout=3).status_code == 200
            except requests.RequestException:
                ok = False
            if not ok and self.first_unhealthy is None:
                self.first_unhealthy = time.time()
            self._stop.wait(1.0)

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _answers(backend: ComposeCluster, model: str) -> bool:
    try:
        r = requests.post(f"{backend.base_url}/completions", timeout=60,
                          json={"model": model, "prompt": [1, 2, 3], "max_tokens": 2})
        return r.status_code == 200
    except requests.RequestException:
        return False


def _recover(backend: ComposeCluster, model: str) -> tuple[str, float]:
    """Wait (bounded) for the cluster to answer by itself, else bring it up; return how and seconds."""
    start = time.monotonic()
    while time.monotonic() - start < SELF_RECOVERY_S:
        if backend.is_running() and _answers(backend, model):
            return "by itself", time.monotonic() - start
        # A container stopped by hand (docker kill) is never restarted by its policy.
        if time.monotonic() - start > 20 and "exited" in (backend.state("worker"), backend.state("head")):
            break
        time.sleep(5)
    backend.up()
    return "make up", time.monotonic() - start


@pytest.mark.parametrize("nemesis", nemeses.NEMESES, ids=str)
def test_requests_end_within_the_bound_and_the_cluster_comes_back(cluster: LiveCluster, nemesis, profile) -> None:
    if profile != PROFILES[0]:
        pytest.skip("nemeses run on the first profile only (each costs a cluster recovery)")
    backend = cluster.backend
    if not isinstance(backend, ComposeCluster):
        pytest.skip("nemeses act on containers: TESTBED_CLUSTER=compose")
    model = cluster.settings["TESTBED_SERVED_MODEL"]
    if not (backend.is_running() and _answers(backend, model)):
        backend.up()  # an earlier nemesis left it down: start from a healthy cluster
    specs = _specs()
    runner = Runner(backend.base_url, model, HISTORY, str(profile), REQUEST_TIMEOUT_S)
    before = runner.run("nemesis-before", specs)
    assert all(r.ok for r in before), f"the cluster did not answer before the fault: {timeouts.check(before)}"

    stream = Stream(runner, specs)
    with HealthWatch(backend.base_url.removesuffix("/v1") + "/health") as health:
        stream.start()
        time.sleep(LEAD_S)
        fault_at = time.time()
        nemesis.apply(backend)
        stream.stop_at = fault_at + FAULT_BOUND_S
        time.sleep(max(0.0, fault_at + nemeses.HOLD_S - time.time()))
        nemesis.heal(backend)
        stream.join(REQUEST_TIMEOUT_S + 30)
    bound = faults.check(stream.records, fault_at, FAULT_BOUND_S)
    how, recovery_s = _recover(backend, model)
    after = runner.run("nemesis-after", specs)
    same = bitexact.check(after, bitexact.first_answers(before))
    errors = sorted({(r.error or "")[:120] for r in stream.records if not r.ok and r.started + r.latency_s >= fault_at})
    FAULTS.append({
        "nemesis": nemesis.name, "what": nemesis.what, "bound_s": FAULT_BOUND_S,
        "requests": int(bound.figures.get("requests", 0)), "failed": int(bound.figures.get("failed", 0)),
        "first_error_s": round(bound.figures.get("first_error_s", -1.0), 1),
        "last_end_s": round(bound.figures.get("last_end_s", 0.0), 1), "within_bound": bound.ok,
        "unhealthy_after_s": round(health.first_unhealthy - fault_at, 1) if health.first_unhealthy else None,
        "recovered": how, "recovery_s": round(recovery_s, 1), "bit_exact_after": same.ok and all(r.ok for r in after),
        "errors": errors[:3],
    })
    judge(cluster, bound, timeouts.check(after), same)

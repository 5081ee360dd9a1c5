"""What the e2e suites share: the run's settings and state, the reference's answers, a profile's
live cluster, the judge.

pytest glue, kept out of the library (``src/`` neither imports pytest nor holds run state):
fixtures and hooks live in ``live/plugin.py``; this module holds the run-wide objects they hand
to tests, so that test modules import them from one place (``from live.suite import ...``).

The checker modules tests use come from here too (``from live.suite import bitexact, timeouts``):
the same modules, whose checkers also save each call, its inputs and its verdict, into the run's
folder (``checker/evidence.py``), and ``judge`` saves what it is given, so that
``python -m vllm_zerocopy_testbed.report recheck reports/<run>`` judges the run again offline.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from vllm_zerocopy_testbed.checker import Verdict, evidence
from vllm_zerocopy_testbed.checker import bitexact as _bitexact, faults as _faults, latency as _latency
from vllm_zerocopy_testbed.checker import schedule as _schedule, timeline as _timeline, timeouts as _timeouts
from vllm_zerocopy_testbed.checker import transport as _transport
from vllm_zerocopy_testbed.cluster.interface import Cluster
from vllm_zerocopy_testbed.host_config import ClusterSettings, E2ERun, Profile, cluster_backend, e2e_profiles
from vllm_zerocopy_testbed.known import death_evidence
from vllm_zerocopy_testbed.model import spec_for
from vllm_zerocopy_testbed.report import RunReport
from vllm_zerocopy_testbed.workload.catalog import EmbedsSizes, structured_unmet
from vllm_zerocopy_testbed.workload.requests import CompletionSpec, History, Record
from vllm_zerocopy_testbed.workload.runner import Runner
from vllm_zerocopy_testbed.workload.warmup import is_healthy

PROFILES, MODES_CHOSEN = e2e_profiles()
SETTINGS = ClusterSettings.from_env()
RUN = E2ERun.from_env(SETTINGS)
RUN_DIR = RUN.report_dir
REQUEST_TIMEOUT_S = RUN.request_timeout_s
LATENCY_BUDGET = RUN.latency_budget
SIZES = EmbedsSizes.for_chunk(int(SETTINGS.values.get("VLLM_MQ_MAX_CHUNK_BYTES_MB", "16")))
# The model the run's clusters and reference serve (the node image's variant at TESTBED_MODEL): prompt_embeds
# are its rows, so that embeds of a token's row answer as the token id.
MODEL_SPEC = spec_for(SETTINGS["TESTBED_MODEL"])
# What the run's clusters lack for the structured suite. Nothing (`make e2e` sets the variant, 128
# sequences and the timeline for every cluster): it runs first on each V2 profile's own cluster and
# asks the run's reference for its answers; else it brings up clusters and a reference of its own
# (tests/e2e/test_structured.py).
STRUCTURED_UNMET = structured_unmet(SETTINGS.values) if cluster_backend() == "compose" else ["not a compose cluster"]

HISTORY = History()
# Every checker call and judged verdict of the run, saved under RUN_DIR/evidence (live/plugin.py
# names the test each belongs to).
EVIDENCE = evidence.Recorder(RUN_DIR)
bitexact, faults, latency, schedule, timeline, timeouts, transport = (
    EVIDENCE.module(m) for m in (_bitexact, _faults, _latency, _schedule, _timeline, _timeouts, _transport))
REPORT = RunReport(profiles=[str(p) for p in PROFILES])
# Profiles whose cluster this run brought up (a `make up` cluster is used and left as found).
STARTED_BY_RUN: set[str] = set()
# One row per nemesis run (tests/faults/test_nemeses.py): written as faults.json / faults.md.
FAULTS: list[dict] = []


@dataclass
class Reference:
    """The single-process server's answers (first per key) and every record; ``runner`` sends to it
    while it is up (the whole session: latency pairs each cluster request with it)."""

    answers: dict[str, Record]
    records: list[Record]
    runner: Runner | None = None


class LiveCluster:
    """A profile's running cluster, and whether its engine died (then later tests fail fast)."""

    def __init__(self, backend: Cluster, profile: Profile) -> None:
        self.backend = backend
        self.profile = profile
        self.dead: str | None = None

    @property
    def settings(self) -> ClusterSettings:
        return self.backend.settings

    def healthy(self) -> bool:
        return is_healthy(self.backend.base_url.removesuffix("/v1"))

    def _runner(self) -> Runner:
        """A runner for this profile's cluster; fail fast if an earlier workload killed the engine."""
        if self.dead:
            pytest.fail(f"not run: {self.dead}")
        return Runner(self.backend.base_url, self.settings["TESTBED_SERVED_MODEL"], HISTORY, str(self.profile),
                      REQUEST_TIMEOUT_S)

    def run(self, suite: str, specs: list[CompletionSpec], *, concurrency: int = 1,
            seconds: float | None = None, paired: Reference | None = None) -> list[Record]:
        """Run a workload; fail fast if an earlier one killed the engine; note a death it causes.

        ``paired``: each request goes to the reference just before (``latency.check`` reads the pairs)."""
        runner = self._runner()
        if seconds is not None:
            records = runner.run_for(suite, specs, seconds)
        else:
            records = runner.run(suite, specs, concurrency=concurrency,
                                 paired=paired.runner if paired is not None else None)
        failed = next((r for r in records if not r.ok), None)
        if failed is not None:
            self.died(suite, f"{failed.key}: {failed.error}")
        return records

    def died(self, suite: str, what: str) -> str | None:
        """After a failed request of ``suite`` (``what``): if the server no longer answers, note the
        engine's death, which later tests fail fast quoting, and return it. The cause goes with the
        death, so a known failure (known.E2E) matches them only if that cause is the one it names."""
        if self.healthy():
            return None
        self.dead = f"the engine died in suite {suite!r} ({what}); server log: {self.evidence(3)}"
        return self.dead

    def run_staggered(self, suite: str, specs: list[CompletionSpec], *, clients: int,
                      seconds: float) -> list[Record]:
        """``clients`` clients for ``seconds``, each pausing a seeded 0-0.4 s before each request."""
        return self._runner().run_staggered(suite, specs, clients=clients, seconds=seconds)

    def evidence(self, lines: int = 30) -> str:
        """Return the server log lines that say why requests failed: the first line of each cause
        (a channel timeout, a raylet check, a dead engine), then the latest error lines."""
        return death_evidence(self.backend.logs(), lines)


def match_reference(records: list[Record], reference: Reference) -> list[Verdict]:
    """Tokens identical to the reference's; logprobs within 1e-5 (TP=2 sums fp32 partials in another order)."""
    return [bitexact.check(records, reference.answers, tokens_only=True, name="tokens = reference"),
            bitexact.check(records, reference.answers, tolerance=1e-5, name="logprobs ~ reference (1e-5)")]


def within_budget(cluster: LiveCluster, records: list[Record]) -> Verdict:
    """The cluster within ``LATENCY_BUDGET`` x the reference beside it, and no request stalled."""
    return latency.check(records, LATENCY_BUDGET)


def judge(cluster: LiveCluster, *verdicts: Verdict) -> None:
    """Fail with every failed verdict's problems, and the server's evidence when requests failed."""
    EVIDENCE.given(verdicts)
    failed = [v for v in verdicts if not v.ok]
    if failed:
        text = "\n".join(str(v) for v in failed)
        if any(v.checker == "timeouts" for v in failed):
            text += f"\n--- server and node logs ({cluster.profile}) ---\n{cluster.evidence()}"
        pytest.fail(text, pytrace=False)

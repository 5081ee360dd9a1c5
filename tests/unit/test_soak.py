"""The soak's judgement over made-up series: growth rates and budgets, minutes, grammar, reports."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from vllm_zerocopy_testbed.host_config import ClusterSettings, parse_duration
from vllm_zerocopy_testbed.soak import analysis, report
from vllm_zerocopy_testbed.soak.__main__ import main, workload
from vllm_zerocopy_testbed.soak.analysis import Sample
from vllm_zerocopy_testbed.workload.requests import CompletionSpec, Record

pytestmark = pytest.mark.unit


def _series(node: str, metric: str, per_minute: float, minutes: int = 30, spike_at: int | None = None,
            base: float = 1000.0) -> list[Sample]:
    samples = []
    for m in range(minutes + 1):
        value = base + per_minute * m + (500.0 if m == spike_at else 0.0)
        samples.append(Sample(m * 60.0, node, {metric: value}))
    return samples


def test_a_steady_leak_is_its_slope_per_hour_and_fails_its_budget() -> None:
    rates = analysis.growth(_series("worker", "rss_mb", per_minute=2.0), warmup_s=120)
    (rate,) = rates
    assert rate.per_hour == pytest.approx(120.0) and rate.samples == 29, "samples before the warm-up are left out"
    verdict = analysis.check_growth(rates)
    assert not verdict.ok and "worker rss_mb: grows 120.00 MB/hour, at least 120.00 (95% bound), budget 64" in str(verdict)


def test_one_spike_does_not_make_a_leak_and_a_flat_series_passes() -> None:
    rates = analysis.growth(_series("head", "rss_mb", per_minute=0.0, spike_at=20)
                            + _series("head", "fds", per_minute=0.0), warmup_s=120)
    assert [r.per_hour for r in rates] == [0.0, 0.0]
    assert analysis.check_growth(rates).ok


def test_a_failed_sample_and_an_unseen_figure_are_left_out() -> None:
    samples = _series("worker", "shm_files", per_minute=0.0) + [Sample(900.0, "worker", {}, "LookupError: gone")]
    (rate,) = analysis.growth(samples, warmup_s=0)
    assert rate.metric == "shm_files" and rate.samples == 31
    assert not analysis.check_growth(analysis.growth(samples[:2], warmup_s=0)).ok, "too few samples to judge"


def test_the_theil_sen_slope_ignores_an_outlier_that_least_squares_follows() -> None:
    points = [(float(x), float(x)) for x in range(10)] + [(10.0, 100.0)]
    assert analysis.theil_sen(points) == pytest.approx(1.0)
    assert analysis.theil_sen([(1.0, 5.0)]) == 0.0


def _record(key: str, started: float, latency: float, ok: bool = True, text: str = "",
            finish: str = "stop") -> Record:
    return Record(key=key, suite="soak", profile="p", bound_s=120, started=started, latency_s=latency,
                  status="ok" if ok else "error", choices=[{"text": text, "finish_reason": finish}])


def test_minutes_count_requests_by_when_they_ended() -> None:
    records = [_record("a", 10, 1.0), _record("a", 50, 20.0), _record("b", 130, 1.0, ok=False)]
    minutes = analysis.per_minute(records, started=0.0)
    assert [(m.minute, m.requests, m.failed) for m in minutes] == [(0, 1, 0), (1, 1, 0), (2, 1, 1)]
    assert minutes[1].p50_s == 20.0 and minutes[2].p50_s == 0.0, "a failed request has no latency"


def test_a_structured_answer_outside_its_grammar_fails_and_a_cut_one_is_not_judged() -> None:
    specs = [CompletionSpec("structured/0", prompt_ids=(1,), regex="[0-9]{3}")]
    verdict = analysis.check_structured([_record("structured/0", 0, 1, text="123"),
                                         _record("structured/0", 0, 1, text="12", finish="length"),
                                         _record("structured/0", 0, 1, text="12a")], specs)
    assert not verdict.ok and verdict.figures["judged"] == 2 and "'12a' is outside its grammar" in str(verdict)


@pytest.mark.parametrize("text, seconds", [("30m", 1800), ("90s", 90), ("2h", 7200), ("1h30m", 5400), (" 1.5m", 90)])
def test_durations_need_a_unit(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["30", "", "m", "30 minutes", "0m", "-5m"])
def test_a_bad_duration_says_how_to_write_one(text: str) -> None:
    with pytest.raises(ValueError, match="DURATION="):
        parse_duration(text)


def test_the_workload_mixes_every_kind_and_transport_size() -> None:
    specs = workload(ClusterSettings.from_env({}))
    kinds = [s.key.split("/")[0] for s in specs]
    assert {"ids", "embeds", "logprobs", "prompt-logprobs", "structured"} <= set(kinds)
    assert kinds[:5] == sorted(set(kinds[:5]), key=kinds[:5].index) and len(set(kinds[:5])) == 5, "kinds interleaved"
    sizes = {s.key.rsplit("/", 1)[-1] for s in specs if s.key.startswith("embeds/")}
    assert {"small", "oob", "overflow", "batch"} <= sizes
    assert len({s.key for s in specs}) == len(specs)


def test_the_report_files_say_what_failed(tmp_path) -> None:
    samples = _series("worker", "shm_mb", per_minute=1.0) + _series("worker", "rss_mb", per_minute=0.0)
    records = [_record("a", 10, 1.0), _record("a", 70, 1.0, ok=False)]
    verdicts = analysis.Verdicts([analysis.check_growth(analysis.growth(samples, 120))])
    meta = {"duration_s": 1800, "clients": 3, "sample_s": 60, "warmup_s": 120, "cluster": "ComposeCluster",
            "modes": ["broadcast=testbed detach=testbed"], "distinct_requests": 1, "started": "now"}
    paths = report.write(tmp_path, meta, records, samples, 0.0, 120, verdicts)
    assert sorted(p.name for p in paths) == ["junit.xml", "soak.json", "soak.md", "soak.png"]
    data = json.loads((tmp_path / "soak.json").read_text())
    assert data["ok"] is False and data["requests"] == {"total": 2, "failed": 1}
    md = (tmp_path / "soak.md").read_text()
    assert "**FAIL**" in md and "| worker | shm_mb |" in md and "+60.00 MB" in md
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    failed = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None]
    assert failed == ["growth", "growth worker shm_mb"] and suite.get("failures") == "2"
    assert (tmp_path / "soak.png").stat().st_size > 10_000


def _answer(key: str, tokens: list[int], logprobs: list[float]) -> Record:
    return Record(key=key, suite="soak", profile="p", bound_s=120, started=0.0, latency_s=1.0,
                  choices=[{"text": "", "tokens": tokens, "token_logprobs": logprobs, "top_logprobs": []}])


def test_answers_keep_their_tokens_and_their_logprobs_within_the_tolerance() -> None:
    firsts = {"a": _answer("a", [1, 2], [-1.0, -2.0])}
    same, moved = analysis.check_first_answers([_answer("a", [1, 2], [-1.0, -2.0]),
                                                _answer("a", [1, 2], [-1.0, -2.0 + 1.5e-6])], firsts)
    assert same.ok and moved == ["a"] and same.figures["bit_identical"] == 1 and same.figures["within_tolerance"] == 1
    for wrong in (_answer("a", [1, 3], [-1.0, -2.0]), _answer("a", [1, 2], [-1.0, -2.001])):
        verdict, _ = analysis.check_first_answers([wrong], firsts)
        assert not verdict.ok, f"{wrong.choices} differs from the first answer"


def test_the_process_whose_memory_grows_is_named() -> None:
    samples = []
    for m in range(31):
        samples.append(Sample(m * 60.0, "worker", {"rss_mb": 3000.0 + m, "rss_mb/ray::RayWorkerProc.run[178]": 2000.0 + m,
                                                   "rss_mb/raylet[35]": 34.0}))
    rates = analysis.process_growth(samples, warmup_s=120)
    assert [(r.metric, round(r.per_hour)) for r in rates] == [("ray::RayWorkerProc.run[178]", 60), ("raylet[35]", 0)]
    assert "| worker | ray::RayWorkerProc.run[178] | 2002 MB | 2030 MB | +60.0 MB |" in report.process_table(rates)


def _heap_series(rss: float, in_use: float, kept: float) -> list[Sample]:
    """30 minutes of one node growing by the given MB per minute."""
    return [Sample(m * 60.0, "worker", {"rss_mb": 3000 + rss * m, "heap_in_use_mb": 500 + in_use * m,
                                        "heap_free_mb": 50 + kept * m, "rss_mb/ray::RayWorkerProc.run[9]": 2000 + rss * m,
                                        "heap_free_mb/ray::RayWorkerProc.run[9]": 40 + kept * m})
            for m in range(31)]


@pytest.mark.parametrize(("in_use", "kept", "cause"), [
    (0.0, 4.5, "freed memory kept by glibc's heap, not a leak"),
    (4.0, 0.5, "memory in use grows: a leak"),
    (0.0, 0.5, "outside the C heap"),
])
def test_rss_growth_is_split_into_memory_in_use_and_memory_glibc_kept(in_use: float, kept: float, cause: str,
                                                                      tmp_path) -> None:
    samples = _heap_series(5.0, in_use, kept)
    rates = analysis.growth(samples, 120)
    explaining = analysis.growth(samples, 120, analysis.EXPLAINING)
    (line,) = analysis.where_rss_goes(rates, explaining)
    assert line.startswith(f"worker: RSS +300 MB/hour = heap in use {in_use * 60:+.0f} + freed but kept {kept * 60:+.0f}")
    assert cause in line
    heap_in_use = next(r for r in rates if r.metric == "heap_in_use_mb")
    assert heap_in_use.ok is (in_use * 60 <= 64), "memory in use has RSS's budget"
    meta = {"duration_s": 1800, "clients": 3, "sample_s": 60, "warmup_s": 120, "cluster": "ComposeCluster",
            "modes": [], "distinct_requests": 1, "started": "now", "node_env": "MALLOC_ARENA_MAX=2"}
    report.write(tmp_path, meta, [], samples, 0.0, 120, analysis.Verdicts([analysis.check_growth(rates)]))
    md = (tmp_path / "soak.md").read_text()
    assert cause in md and "node environment: MALLOC_ARENA_MAX=2" in md
    assert f"| worker | ray::RayWorkerProc.run[9] | 2010 MB | 2150 MB | +300.0 MB | {kept * 60:+.1f} MB |" in md


def test_memory_in_use_that_passes_its_budget_is_not_called_a_leak() -> None:
    """Seen on a fresh clone (reports/soak-fresh-5m-sig): heap in use +90 MB/hour, all of it the known
    oneDNN cache, passed; the RSS line still said "a leak"."""
    rss = analysis.Growth("head", "rss_mb", 67.0, 64.0, 5905, 5906, 11, known=137.6, low=-151.0)
    in_use = analysis.Growth("head", "heap_in_use_mb", 90.4, 64.0, 2985, 2995, 11, known=126.4,
                             known_as="onednn-primitive-cache", low=-160.4)
    kept = analysis.Growth("head", "heap_free_mb", -121.0, float("inf"), 193, 182, 11)
    (line,) = analysis.where_rss_goes([rss, in_use], [kept])
    assert in_use.ok and "a leak" not in line and "known growth (onednn-primitive-cache)" in line, line
    leak = analysis.Growth("head", "heap_in_use_mb", 90.4, 64.0, 2985, 2995, 11, low=80.0)
    (line,) = analysis.where_rss_goes([rss, leak], [kept])
    assert not leak.ok and "memory in use grows: a leak" in line


def test_without_heap_figures_the_rss_growth_says_so() -> None:
    rates = analysis.growth(_series("head", "rss_mb", per_minute=2.0), 120)
    (line,) = analysis.where_rss_goes(rates, [])
    assert "no heap figures" in line


def _known_series(rss_per_minute: float, vars_per_minute: float, minutes: int = 30) -> list[Sample]:
    return [Sample(m * 60.0, "head", {"rss_mb": 5000 + rss_per_minute * m, "context_vars": 10 + vars_per_minute * m})
            for m in range(minutes + 1)]


KNOWN = analysis.KnownGrowth("contextvar-per-forward", "context_vars", {"rss_mb": 0.001}, "one per forward")


def test_a_known_growth_is_judged_without_the_part_its_signature_accounts_for() -> None:
    # RSS +120 MB/hour; 1,500 variables a minute at 1 kB each account for +90 of it: +30 left, in budget.
    (rate,) = analysis.growth(_known_series(2.0, 1500.0), 120, {"rss_mb": 64.0}, [KNOWN])
    assert rate.per_hour == pytest.approx(120.0) and rate.known == pytest.approx(90.0)
    assert rate.known_as == "contextvar-per-forward" and rate.ok
    (line,) = analysis.known_growth(_known_series(2.0, 1500.0), 120, [KNOWN])
    assert line == ("head: contextvar-per-forward (known: one per forward): context_vars +90,000/hour, "
                    "accounts for rss_mb +90.0 MB/hour")


def test_a_known_growth_does_not_hide_another_one() -> None:
    # The same known growth plus a leak of 100 MB/hour: judged on what is not known.
    (rate,) = analysis.growth(_known_series(2.0 + 100 / 60, 1500.0), 120, {"rss_mb": 64.0}, [KNOWN])
    verdict = analysis.check_growth([rate])
    assert not verdict.ok and ("grows 220.00 MB/hour, of which 90.00 known (contextvar-per-forward), at least 130.00 "
                               "not known (95% bound)") in str(verdict)
    # Without its signature (a flat count, or no probe) nothing is known.
    (flat,) = analysis.growth(_known_series(2.0, 0.0), 120, {"rss_mb": 64.0}, [KNOWN])
    assert flat.known == 0.0 and not flat.ok
    (unseen,) = analysis.growth(_series("head", "rss_mb", per_minute=2.0), 120, {"rss_mb": 64.0}, [KNOWN])
    assert unseen.known == 0.0 and not unseen.ok
    assert analysis.known_growth(_known_series(2.0, 0.0), 120, [KNOWN]) == []


def test_bad_soak_arguments_are_refused_before_anything_starts(capsys) -> None:
    for argv, words in ((["--clients", "0"], "--clients must be at least 1"), (["--warmup", "5"], "use a number with a unit"),
                        (["--duration", "0s"], "must be longer than zero")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_a_short_noisy_window_fails_only_what_its_samples_resolve() -> None:
    # Measured worker RSS over a 5 min window (reports/soak-5m-c, MB): noise of +-40 MB a sample.
    noisy = [4744.0, 4760.0, 4778.0, 4822.0, 4795.0, 4849.0, 4801.0, 4770.0, 4790.0, 4812.0, 4765.0]
    flat = [Sample(30.0 * i, "worker", {"rss_mb": v}) for i, v in enumerate(noisy)]
    (rate,) = analysis.growth(flat, 0, {"rss_mb": 64.0}, [])
    assert rate.per_hour > 64.0 and rate.low < 64.0 and rate.ok, "a slope the noise allows is not a leak"
    # The same noise on top of a leak of 1 GB/hour: resolved.
    leak = [Sample(s.at, "worker", {"rss_mb": s.figures["rss_mb"] + 1000.0 * s.at / 3600}) for s in flat]
    (rate,) = analysis.growth(leak, 0, {"rss_mb": 64.0}, [])
    assert rate.low > 64.0 and not rate.ok
    assert analysis.theil_sen_lower([(0.0, 0.0), (1.0, 1.0), (2.0, 2.0)]) == pytest.approx(1.0)

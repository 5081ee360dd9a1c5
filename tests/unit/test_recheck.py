"""A run's evidence: checker calls saved with their inputs, judged again offline with the same verdicts.

The run folders here are made the way an e2e run makes them (``evidence.Recorder``, real
checkers) from log text written the way the nodes write it: the wire tap's ``mq-send`` lines and
the timeline's ``mq-timeline`` events through a logger formatted as ``observe/log.py``'s, behind
compose's and Ray's line prefixes, among vLLM's own lines.
"""

from __future__ import annotations

import ast
import gzip
import json
import logging
import math
from pathlib import Path

import pytest

from vllm_zerocopy_testbed import report
from vllm_zerocopy_testbed.checker import Verdict, bitexact, evidence, timeouts
from vllm_zerocopy_testbed.patches import timeline as timeline_patch
from vllm_zerocopy_testbed.patches.wiretap import wire_line
from vllm_zerocopy_testbed.workload.requests import Event, Record

pytestmark = pytest.mark.unit

MiB = 1 << 20
TENSOR = 2100 * 512  # an ``oob`` prompt_embeds tensor in fp32
TEST = "tests/e2e/test_embeds.py::test_large_embeds_cross_to_the_remote_stage_out_of_band[v2/testbed-oob]"


@pytest.fixture
def node_log(timeline_log):
    """A logger as the nodes have, and the timeline writer writing to it; the lines as nodes write them."""
    return timeline_log.logger, timeline_log.lines


def _compose(lines: list[str]) -> str:
    """``docker compose logs`` of a run: the testbed's lines behind the services' and Ray's prefixes,
    among vLLM's lines, a cut line, CRLF line ends and a whitespace-only line."""
    noise = ["head-1    | INFO 12-07 02:50:11 [core.py:93] Initializing a V1 LLM engine (v0.32.0)",
             "worker-1  | (raylet) [2026-12-07 02:50:12,004 I 88 88] logging.cc:230: Set ray log level",
             'head-1    | (EngineCore pid=41) INFO [testbed] mq-timeline {"ev":"recv",',  # cut by the log driver
             "head-1    | WARNING an mq-send without frames=",
             "   "]
    out = []
    for i, line in enumerate(lines):
        prefix = "worker-1  | (RayWorkerProc pid=412) " if i % 3 == 2 else "head-1    | (EngineCore pid=41) "
        out.append(prefix + line + ("\r" if i % 4 == 1 else ""))
        out.append(noise[i % len(noise)])
    return "\n".join(out) + "\n"


def _wire_log(log: logging.Logger, lines: list[str], sizes: list[list[int]]) -> str:
    for frames in sizes:
        log.info(wire_line("remote", frames))  # what the wire tap logs for each large send
    log.info(wire_line("overflow", [5000, TENSOR]))
    return _compose(lines)


def _timeline_log(log: logging.Logger, lines: list[str], *, overlap: bool) -> str:
    """Two out-of-band sample_tokens frames handed to ZMQ, read by a reader, released; then the
    grammar bitmask's next fill into the same memory: before the second release where ``overlap``
    (the race of upstream PR 53217, the reader then gets other bytes), else after it."""
    emit = timeline_patch._emit  # the writer's own line format (``patches/timeline.py``)
    for seq, (sent, released) in enumerate(((1.000, 1.004), (2.000, 2.010))):
        key = {"pid": 41, "port": 5557, "seq": seq, "frame": 1}
        emit({"ev": "send", **key, "path": "remote", "kind": "sample_tokens", "addr": 4096, "nbytes": 2 * MiB,
              "crc": 7, "t": sent})
        emit({"ev": "recv", "pid": 412, "port": 5557, "seq": seq, "frame": 1, "nbytes": 2 * MiB,
              "crc": 8 if overlap and seq == 1 else 7})
        emit({"ev": "release", **key, "t": released})
    emit({"ev": "write", "pid": 41, "kind": "grammar_bitmask", "addr": 4096, "nbytes": 2 * MiB, "rows": 48,
          "t": 2.005 if overlap else 2.020})
    return _compose(lines)


def _record(key: str, latency_s: float = 1.0, status: str = "ok", tokens=(1, 2), lps=(-0.5, -1.25),
            reference_latency_s: float | None = 0.5, started: float = 100.0) -> Record:
    choice = {"text": "ab", "tokens": list(tokens), "token_logprobs": list(lps),
              "top_logprobs": [{str(t): lp} for t, lp in zip(tokens, lps)],
              "prompt_logprobs": [None, {"7": {"logprob": -2.5, "rank": 1, "decoded_token": "x"}}]}
    return Record(key=key, suite="embeds", profile="v2/testbed", bound_s=120.0, started=started, latency_s=latency_s,
                  status=status, reference_latency_s=reference_latency_s,
                  error=None if status == "ok" else "Error code: 500", http_status=None if status == "ok" else 500,
                  choices=[choice] if status == "ok" else [])


def _records() -> list[Record]:
    return [_record(f"embeds/float32/k{i}", latency_s=1.0 + i / 10, started=100.0 + 3 * i) for i in range(8)] + [
        _record("logprobs/nan", lps=(-0.5, math.nan), started=130.0)]


def _run(tmp_path: Path, node_log) -> Path:
    """A run folder with one call of every registered checker, as an e2e run saves them."""
    log, lines = node_log
    run = tmp_path / "e2e-run"
    recorder = evidence.Recorder(run)
    records = _records()
    expected = bitexact.first_answers(records)
    recorder.start("tests/e2e/test_embeds.py::test_every_request_answers_within_its_bound[v2/testbed]")
    recorder.given([recorder.judged("timeouts.check", records)])
    recorder.start("tests/e2e/test_embeds.py::test_repeats_are_bit_exact[v2/testbed]")
    recorder.given([recorder.judged("timeouts.check", records),
                    recorder.judged("bitexact.check", (r for r in records), expected, tolerance=1e-5, name="rep")])
    recorder.start("tests/e2e/test_embeds.py::test_latency_is_within_budget_of_the_reference[v2/testbed]")
    recorder.given([recorder.judged("latency.check", records, 1.5)])
    recorder.start("tests/faults/test_nemeses.py::test_requests_end_within_the_bound[kill-worker]")
    events = [Event(at=105.0, kind="kill-worker", phase="apply", target="worker", profile="v2/testbed")]
    recorder.judged("faults.check", records, events, 60.0)
    recorder.start("tests/e2e/test_across.py::test_every_profile_gives_the_same_answers")
    recorder.judged("bitexact.across", {"v2/testbed": expected, "v2/upstream": expected})
    recorder.start("tests/faults/test_fault_schedule.py::test_a_fault_schedule_keeps_every_request_bounded")
    recorder.judged("schedule.check_run", _schedule_run(records))
    evidence.judged(run, TEST, "transport.check_out_of_band", logs=_wire_log(log, lines, [[900, TENSOR]]),
                    tensor_bytes=TENSOR, path="remote")
    lines.clear()
    recorder.start("tests/e2e/test_structured.py::test_the_grammar_bitmask_is_never_rewritten[v2/upstream]")
    verdict = recorder.judged("timeline.check_no_overlap", _timeline_log(log, lines, overlap=True),
                              need_kind="sample_tokens")
    assert not verdict.ok
    built = Verdict("batch = parts")
    built.fail("part 0: tokens [1] vs [2]")
    recorder.given([verdict, built])
    return run


def _schedule_run(records: list[Record]) -> dict:
    steps = [{"index": 0, "kind": "pause", "node": "worker", "phase": "apply", "started": 110.0, "ended": 111.0,
              "error": None},
             {"index": 0, "kind": "pause", "node": "worker", "phase": "heal", "started": 115.0, "ended": 116.0,
              "error": None}]
    rows = [r.to_json() for r in records if r.ok]
    return {"schedule": {"ops": [{"kind": "pause"}]}, "records": rows, "before": rows, "after": rows, "steps": steps,
            "bound_s": 60.0, "ends_at": 200.0, "recovery_bound_s": 180.0, "states": {"worker": "running"},
            "leftovers": []}


def _saved(run: Path, test: str) -> list[dict]:
    path = run / "evidence" / f"{evidence.safe_name(test)}.jsonl.gz"
    with gzip.open(path, "rt") as lines:
        return [json.loads(line) for line in lines]


def _edit_log(run: Path, test: str, old: str, new: str) -> None:
    """Change a saved log line in place, as someone editing the evidence would."""
    digest = next(r for r in _saved(run, test) if r["kind"] == "check")["arguments"]["logs"]["$log"]
    path = run / "evidence" / "blobs" / f"{digest}.txt.gz"
    text = gzip.decompress(path.read_bytes()).decode()
    assert old in text
    path.write_bytes(gzip.compress(text.replace(old, new).encode()))


# -- judged again: the same ------------------------------------------------------------------------------
def test_a_saved_run_is_judged_again_with_the_same_verdicts(tmp_path, node_log, capsys) -> None:
    run = _run(tmp_path, node_log)
    results = evidence.recheck(run)
    assert len(results) == 8 and all(t.same for t in results), evidence.lines(results)
    assert sum(len(t.calls) for t in results) == 9
    assert report.main(["recheck", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert all(line.startswith("SAME ") for line in out[:-1]) and len(out) == 9, out
    assert f"SAME       {TEST}  saved ok  now ok" in out
    structured = next(line for line in out if "test_structured" in line)
    assert "saved FAIL 1/1  now FAIL 1/1 (1 built in the test: not re-checkable)" in structured
    assert out[-1].startswith("8 tests, 9 checker calls judged again: 9 same, 0 different in 0 test(s); 1 verdict")


def test_a_record_says_what_was_judged_and_the_records_are_stored_once(tmp_path, node_log) -> None:
    run = _run(tmp_path, node_log)
    saved = _saved(run, TEST)
    assert [r["kind"] for r in saved] == ["check"]
    check = saved[0]
    assert check["checker"] == "transport.check_out_of_band" and check["test"] == TEST
    assert check["arguments"]["tensor_bytes"] == TENSOR and check["arguments"]["path"] == "remote"
    assert check["arguments"]["logs"]["lines"] == 2 and check["arguments"]["logs"]["cut"] == 0
    assert check["verdict"] == {"checker": "zero-copy (remote)", "ok": True, "problems": [], "figures": {"sends": 1}}
    # the same records judged by two tests and three checkers: one blob
    repeats = _saved(run, "tests/e2e/test_embeds.py::test_repeats_are_bit_exact[v2/testbed]")
    blobs = {json.dumps(r["arguments"].get("records")) for r in repeats if r["kind"] == "check"}
    assert len(blobs) == 1 and "$blob" in next(iter(blobs))
    judged = repeats[-1]
    assert judged["kind"] == "judged" and [v["from"] for v in judged["verdicts"]] == ["check", "check"]


def test_a_verdict_the_test_changed_after_the_checker_is_saved_as_amended(tmp_path) -> None:
    recorder = evidence.Recorder(tmp_path / "run", "t")
    verdict = recorder.judged("timeouts.check", [_record("a")])
    verdict.fail("the engine logged `grammar rejected tokens [3] for request`")
    recorder.given([verdict])
    judged = _saved(tmp_path / "run", "t")[-1]["verdicts"][0]
    assert judged["from"] == "check" and judged["amended"] and not judged["verdict"]["ok"]
    [test] = evidence.recheck(tmp_path / "run")
    assert test.same and test.amended == 1  # the checker's own verdict is what is judged again


def test_recorded_modules_save_their_checkers_and_leave_the_rest_alone(tmp_path) -> None:
    recorder = evidence.Recorder(tmp_path / "run", "t")
    recorded = recorder.module(bitexact)
    assert recorded.first_answers is bitexact.first_answers and recorded.differences is bitexact.differences
    records = _records()
    assert recorded.check(records, recorded.first_answers(records), name="tokens = reference").ok
    assert recorder.module(timeouts).check(iter(records)).figures["requests"] == len(records)
    assert [r["checker"] for r in _saved(tmp_path / "run", "t")] == ["bitexact.check", "timeouts.check"]
    assert not (tmp_path / "other").exists()
    evidence.Recorder(tmp_path / "other")  # nothing is written before the first call
    assert not (tmp_path / "other").exists()


# -- judged again: different -----------------------------------------------------------------------------
def test_an_edited_frame_size_is_judged_different(tmp_path, node_log, capsys) -> None:
    """The tensor's frame made part of frame 0 (in band): the zero-copy check now fails, and says so."""
    run = _run(tmp_path, node_log)
    _edit_log(run, TEST, f"frames=900,{TENSOR}", f"frames={900 + TENSOR}")
    assert report.main(["recheck", str(run)]) == 1
    out = capsys.readouterr().out.splitlines()
    line = next(line for line in out if TEST in line)
    assert line == (f"DIFFERENT  {TEST}  saved ok  now FAIL 1/1: zero-copy (remote): no frame carries the "
                    f"{TENSOR}-byte tensor out of band; largest send's frames: [{900 + TENSOR}] (in band: the "
                    "tensor was copied into the pickle stream)")
    assert sum(line.startswith("SAME ") for line in out) == 7
    assert out[-1].startswith("8 tests, 9 checker calls judged again: 8 same, 1 different in 1 test(s)")


def test_an_edited_release_time_is_judged_different(tmp_path, node_log) -> None:
    """The second frame released before the bitmask's next fill: no overlap left, only the changed reader."""
    run = _run(tmp_path, node_log)
    test = "tests/e2e/test_structured.py::test_the_grammar_bitmask_is_never_rewritten[v2/upstream]"
    _edit_log(run, test, '"t":2.01}', '"t":2.001}')
    [structured] = [t for t in evidence.recheck(run) if t.test == test]
    [call] = structured.calls
    assert not call.same and call.now[0]["figures"]["sample_tokens.overlaps"] == 0
    assert call.difference() == ("out-of-band buffers never rewritten in flight: no longer: sample_tokens: 1 of 2 "
                                 "frames written again while ZMQ held them (smallest gap -5.0 ms)")


# -- the saved log lines judge as the whole log ---------------------------------------------------------
def _logs(name: str, log: logging.Logger, lines: list[str]) -> list[tuple[str, dict]]:
    """Whole logs for the log-reading checker ``name``, each with the other arguments: passing and failing."""
    texts = []
    if name == "transport.check_out_of_band":
        for sizes in ([[900, TENSOR]], [[900 + TENSOR]], [[900, 3 * TENSOR], [800, 600 * 1024, TENSOR]], []):
            lines.clear()
            texts.append((_wire_log(log, lines, sizes), {"tensor_bytes": TENSOR, "path": "remote"}))
        texts.append((texts[0][0], {"tensor_bytes": TENSOR, "path": "overflow"}))
        texts.append(("mq-send path=? frames=1,2\r\nmq-send path=remote frames=3,4 mq-send path=remote frames=5,"
                      f"{TENSOR}\n", {"tensor_bytes": TENSOR}))
    elif name == "timeline.check_no_overlap":
        for overlap in (True, False):
            lines.clear()
            text = _timeline_log(log, lines, overlap=overlap)
            texts += [(text, {"need_kind": "sample_tokens"}), (text, {"need_kind": "execute_model"})]
        texts.append(('mq-timeline {"ev":"send","pid":1,"port":2,"seq":0,"frame":1,"path":"remote","kind":"k",'
                      '"addr":0,"nbytes":4,"crc":1,"t":1.0}   \n  \n\nmq-timeline {"ev":"write","pid":1,"kind":"w",'
                      '"addr":0,"nbytes":4,"t":2.0} mq-timeline {"ev":"x"}\n'
                      'mq-timeline {"ev":"write","pid":1,"kind":"w","addr":0,"nbytes":4,"t":3.0}\r\n', {}))
    return texts


@pytest.mark.parametrize("name", sorted(n for n, c in evidence.CHECKERS.items() if c.log_lines))
def test_the_saved_lines_give_the_verdict_of_the_whole_log(name: str, node_log) -> None:
    log, lines = node_log
    entry = evidence.registered(name)
    cases = _logs(name, log, lines)
    assert cases, f"{name} reads logs: give it cases here"
    verdicts = set()
    for text, others in cases:
        for argument, prefixes in entry.log_lines.items():
            kept = evidence.kept_lines(text, prefixes)
            assert len(kept) < len(text)
            whole = evidence.verdict_json(entry.function(**{argument: text}, **others))
            saved = evidence.verdict_json(entry.function(**{argument: kept}, **others))
            assert saved == whole, text
            verdicts.add(json.dumps(whole, sort_keys=True))
    assert len(verdicts) >= 3, "the cases should give passing and failing verdicts"


def test_the_saved_log_is_bounded_keeping_the_latest_lines(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(evidence, "MAX_LOG_BYTES", 1000)
    logs = "\n".join(wire_line("remote", [900, 1000 + i]) for i in range(100)) + "\n" + wire_line("remote", [9, TENSOR])
    recorder = evidence.Recorder(tmp_path / "run", "t")
    assert recorder.judged("transport.check_out_of_band", logs, TENSOR).ok
    saved = _saved(tmp_path / "run", "t")[0]["arguments"]["logs"]
    text = gzip.decompress((tmp_path / "run/evidence/blobs" / f"{saved['$log']}.txt.gz").read_bytes()).decode()
    assert len(text.encode()) <= 1000 and text.endswith(f"frames=9,{TENSOR}")
    assert saved["cut"] == 101 - saved["lines"] and saved["of_lines"] == 101
    # the figures count what was kept: a cut log is evidence the recheck cannot vouch for, and says so
    [line, _] = evidence.lines(evidence.recheck(tmp_path / "run"))
    assert line == ("DIFFERENT  t  saved ok  now ok: zero-copy (remote): figure sends 101 -> 27 [74 log lines were "
                    "past the size cap]")


# -- bad input -------------------------------------------------------------------------------------------
def test_a_checker_not_registered_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(evidence.UnknownChecker, match=r"no checker named 'timeline.path_figures': registered are "
                                                      r"bitexact.across, .*; add it to CHECKERS"):
        evidence.judged(tmp_path, "t", "timeline.path_figures", logs="")
    assert not tmp_path.joinpath("evidence").exists()


def test_a_missing_folder_or_no_evidence_exits_2_with_one_line(tmp_path, capsys) -> None:
    assert report.main(["recheck", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"recheck: {tmp_path / 'nowhere'}: no such run folder (reports/<run>/, as make e2e names it)"]
    (tmp_path / "results.json").write_text("{}")
    assert report.main(["recheck", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "no evidence saved" in err[0]


def test_unreadable_or_unknown_evidence_exits_2(tmp_path, capsys) -> None:
    evidence.judged(tmp_path, "t", "timeouts.check", [_record("a")])
    path = tmp_path / "evidence" / "t.jsonl.gz"
    saved = _saved(tmp_path, "t")[0]
    path.write_bytes(gzip.compress((json.dumps({**saved, "checker": "timeouts.gone"}) + "\n").encode()))
    assert report.main(["recheck", str(tmp_path)]) == 2
    assert "no checker named 'timeouts.gone'" in capsys.readouterr().err
    path.write_bytes(path.read_bytes()[:-9])  # a run killed while writing
    assert report.main(["recheck", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"recheck: {path}: unreadable")


def test_inputs_that_cannot_be_saved_leave_the_verdict_and_show_in_the_recheck(tmp_path, capsys) -> None:
    recorder = evidence.Recorder(tmp_path, "t")
    odd = {"a": _record("a"), 1: _record("b")}  # a key JSON cannot hold
    assert recorder.judged("bitexact.check", [_record("a")], odd).ok
    assert report.main(["recheck", str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("UNSAVED    t  inputs not saved, cannot judge again: bitexact.check: TypeError")


# -- the live suites judge through the recorder ----------------------------------------------------------
TESTS = Path(__file__).resolve().parents[1]
# Live test files whose checker calls are not saved yet, and why.
NOT_RECORDED = {"faults/test_small_shm.py": "judges its own small-shm outcome (faults/small_shm.py); its "
                                           "bitexact.check is not wired to the evidence yet"}


def test_the_live_suites_take_their_checkers_from_the_recording_suite() -> None:
    """A live test that imported a checker module itself would judge without saving its evidence."""
    modules = {name.split(".")[0] for name in evidence.CHECKERS}
    found = []
    for path in sorted([*TESTS.glob("e2e/*.py"), *TESTS.glob("faults/*.py"), TESTS / "live" / "plugin.py"]):
        if str(path.relative_to(TESTS)) in NOT_RECORDED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            package = "vllm_zerocopy_testbed.checker"
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(package):
                continue
            module = (node.module or "").removeprefix(package).lstrip(".")
            names = [a.name for a in node.names]
            found += [f"{path.name}: {module or 'checker'}.{n}" for n in names
                      if (not module and n in modules) or f"{module}.{n}" in evidence.CHECKERS]
    assert not found, f"import these from live.suite (they save their calls): {found}"


def test_the_suite_saves_what_its_helpers_and_judge_are_given_under_the_running_test(tmp_path, monkeypatch,
                                                                                       request) -> None:
    """``live/suite.py`` as the e2e tests use it: ``match_reference``, ``within_budget``, ``judge``;
    the plugin names the running test."""
    from live import suite

    monkeypatch.setattr(suite.EVIDENCE, "run_dir", tmp_path)
    monkeypatch.setattr(suite, "LATENCY_BUDGET", 1.5)  # the records' ratios are 2-2.8
    records = _records()[:-1]  # a NaN logprob is no logprob within a tolerance
    reference = suite.Reference(bitexact.first_answers(records), records)
    verdicts = [suite.timeouts.check(records), *suite.match_reference(records, reference)]
    suite.judge(None, *verdicts)  # every verdict ok: the cluster is not asked for its logs
    with pytest.raises(pytest.fail.Exception, match="the cluster answers"):
        suite.judge(None, suite.within_budget(None, records))
    saved = _saved(tmp_path, request.node.nodeid)
    assert [r.get("checker", r["kind"]) for r in saved] == [
        "timeouts.check", "bitexact.check", "bitexact.check", "judged", "latency.check", "judged"]
    assert {r["test"] for r in saved} == {request.node.nodeid}
    [test] = evidence.recheck(tmp_path)
    assert test.same and len(test.calls) == 4 and not test.built

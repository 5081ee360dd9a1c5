"""Bench statistics and report tables (the measurements themselves run in `make bench`)."""

from __future__ import annotations

import itertools

import pytest

from vllm_zerocopy_testbed.bench.broadcast import BroadcastFigure
from vllm_zerocopy_testbed.bench.report import broadcast_table
from vllm_zerocopy_testbed.bench.stats import Ratio, Sample, interleaved, paired_ratios, spread, until_stable

pytestmark = pytest.mark.unit


def test_spread_is_iqr_over_median() -> None:
    assert spread([10, 10, 10, 10, 10]) == 0
    assert spread([8, 9, 10, 11, 12]) == pytest.approx(0.3)


def test_until_stable_stops_early_when_stable_and_at_the_cap_when_not() -> None:
    steady = until_stable(lambda: 1.0, min_n=5, max_n=100, budget_s=60)
    assert steady.n == 5 and not steady.unstable
    noisy = itertools.cycle([1.0, 3.0])
    capped = until_stable(lambda: next(noisy), min_n=5, max_n=12, budget_s=60)
    assert capped.n == 12 and capped.unstable


def test_interleaved_rotates_the_order_and_pairs_rounds() -> None:
    calls: list[str] = []
    clock = itertools.count(1)

    def timer(name: str):
        return lambda: (calls.append(name), float(next(clock)))[1]

    values = interleaved({"a": timer("a"), "b": timer("b"), "c": timer("c")}, min_n=3, max_n=3, budget_s=60)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert values == {"a": [1.0, 6.0, 8.0], "b": [2.0, 4.0, 9.0], "c": [3.0, 5.0, 7.0]}
    assert paired_ratios(values["b"], values["a"]) == [2.0, 4.0 / 6.0, 9.0 / 8.0]


def test_broadcast_table_gives_ratios_to_memcpy_and_paired_ratio_to_upstream() -> None:
    memcpy = Sample(2.0, 0.01, 9)
    figures = [BroadcastFigure("remote-1", 16 << 20, "upstream", Sample(6.0, 0.02, 7), 0.1, memcpy, 1.0, 0.0),
               BroadcastFigure("remote-1", 16 << 20, "testbed", Sample(6.6, 0.02, 7), 0.1, memcpy, 1.08, 0.12)]
    table = broadcast_table(figures)
    assert "| remote-1 | 16 MiB | upstream | 6.00 | 2% | 0.10 | 2.000 | 3.0 | 1.00 |" in table
    assert "| remote-1 | 16 MiB | testbed | 6.60 | 2% | 0.10 | 2.000 | 3.3 | 1.08 (12% ⚠) |" in table


def test_detach_table_gives_the_paired_ratio_to_upstream_and_the_memcpy_of_the_copied_bytes() -> None:
    from vllm_zerocopy_testbed.bench.detach import DetachFigure
    from vllm_zerocopy_testbed.bench.report import detach_table

    floor = Sample(0.05, 0.02, 400)
    table = detach_table([DetachFigure("aux_rows", "upstream", 2048, Sample(0.8, 0.01, 400),
                                       copied_bytes=300 << 10, memcpy=floor),
                          DetachFigure("aux_rows", "testbed", 2048, Sample(0.7, 0.02, 400),
                                       Ratio(0.87, 0.07, 0.85, 0.9, 400), Ratio(1.0, 0.05, 0.99, 1.01, 200),
                                       300 << 10, floor)])
    assert "| aux_rows | upstream | 0.8000 | 1% | 300 KiB | 0.0500 | 16.0 | - | - |" in table
    assert ("| aux_rows | testbed | 0.7000 | 2% | 300 KiB | 0.0500 | 14.0 | 0.87 [0.85-0.90] (7% ⚠) "
            "| 1.00 [0.99-1.01] (5%) |") in table


def test_the_detach_bench_outputs_are_channel_like_and_fresh() -> None:
    """Each timed output has read-only arrays (as Ray hands them) of its own: a detach cannot reuse work."""
    from vllm_zerocopy_testbed.bench.detach import SHAPES, _Outputs

    for shape in SHAPES:
        outputs = _Outputs(shape, 8)
        a, b = outputs.fresh(), outputs.fresh()
        assert not any(x.flags.writeable for x in a.logprobs[:3]), shape
        assert a.logprobs[0] is not b.logprobs[0], shape
        if shape == "aux_rows":
            rows = [o.rows for o in a.aux_output_connector_output.values()]
            assert len(rows) == 8 and not any(r.flags.writeable for r in rows)


def test_pipeline_table_and_report_carry_the_in_flight_counts(tmp_path) -> None:
    import json

    from vllm_zerocopy_testbed.bench import report
    from vllm_zerocopy_testbed.bench.pipeline import PipelineFigure

    figures = [PipelineFigure("upstream", 2, 20.0, Sample(21.0, 0.02, 8), 1.0, 0.0),
               PipelineFigure("testbed", 1, 20.0, Sample(41.5, 0.01, 8), 1.97, 0.03)]
    table = report.pipeline_table(figures)
    assert "| upstream | 2 | 20 | 21.00 | 2% | - |" in table and "| testbed | 1 | 20 | 41.50 | 1% | 1.97 (3%) |" in table
    report.write(tmp_path, broadcast=[], channel=[], e2e=[], meta={}, pipeline=figures)
    assert json.loads((tmp_path / "bench.json").read_text())["pipeline"][1]["inflight"] == 1
    assert "PP overlap lost" in (tmp_path / "bench.md").read_text()


def test_arena_table_gives_gib_per_s_the_memcpy_goal_where_the_time_goes_and_the_paired_ratio() -> None:
    from vllm_zerocopy_testbed.bench.arena import ArenaFigure
    from vllm_zerocopy_testbed.bench.report import arena_table

    memcpy = Sample(10.0, 0.01, 9)
    table = arena_table([ArenaFigure(2, 64 << 20, "arena upstream", Sample(15.625, 0.02, 9), memcpy,
                                     slot_write_ms=11.0, floor_ms=0.25),
                         ArenaFigure(2, 64 << 20, "arena testbed", Sample(31.25, 0.03, 9), memcpy,
                                     Ratio(2.0, 0.1, 1.9, 2.1, 9), Ratio(1.0, 0.04, 0.98, 1.03, 4), 11.0, 0.25),
                         ArenaFigure(2, 64 << 20, "arena off", Sample(62.5, 0.01, 9), memcpy, floor_ms=0.25)])
    assert "| 2 | 64 MiB | arena upstream | 15.62 | 2% | 4.00 | 10.000 | 1.6 | yes | 11.00 | 0.25 | - | - |" in table
    assert ("| 2 | 64 MiB | arena testbed | 31.25 | 3% | 2.00 | 10.000 | 3.1 | no | 11.00 | 0.25 "
            "| 2.00 [1.90-2.10] (10% ⚠) | 1.00 [0.98-1.03] (4%) |") in table
    assert "| 2 | 64 MiB | arena off | 62.50 | 1% | 1.00 | 10.000 | 6.2 | - | - | 0.25 | - | - |" in table


def test_the_median_interval_holds_the_median_and_widens_with_fewer_rounds() -> None:
    from vllm_zerocopy_testbed.bench.stats import median_ci

    many = [float(v) for v in range(1, 101)]
    low, high = median_ci(many)
    assert 40 <= low < 50.5 < high <= 61 and (low, high) == (41.0, 61.0)
    assert median_ci([3.0, 1.0, 2.0]) == (1.0, 3.0)
    few = median_ci([float(v) for v in range(1, 21)])
    assert few[1] - few[0] > (high - low) / 5


def test_self_ratio_pairs_rounds_where_the_base_held_the_same_place() -> None:
    """Two variants rotated per round: the base is first in even rounds, second in odd ones. Its
    place alone moves its time (second: 10% slower here); the self ratio must not read that."""
    from vllm_zerocopy_testbed.bench.stats import self_ratio

    base = [1.0 if i % 2 == 0 else 1.1 for i in range(40)]
    noise = self_ratio(base)
    assert noise is not None and noise.median == pytest.approx(1.0) and noise.low == pytest.approx(1.0)
    assert self_ratio([1.0, 1.0, 1.0]) is None


def test_goals_say_met_or_the_measured_reason() -> None:
    from vllm_zerocopy_testbed.bench.arena import ArenaFigure
    from vllm_zerocopy_testbed.bench.detach import DetachFigure
    from vllm_zerocopy_testbed.bench.report import goals

    memcpy = Sample(0.5, 0.01, 9)
    same = Ratio(1.0, 0.02, 0.99, 1.01, 50)
    within_noise = Ratio(1.01, 0.02, 0.99, 1.03, 50)  # above 1.00, but its interval reaches it
    broadcast = [BroadcastFigure("remote-1", 1 << 20, "testbed", Sample(0.6, 0.02, 50), 0.4, memcpy, 1.01, 0.02,
                                 within_noise, same),
                 BroadcastFigure("local-4", 16 << 20, "testbed", Sample(6.0, 0.02, 50), 0.4, memcpy, 1.05, 0.02,
                                 Ratio(1.05, 0.02, 1.03, 1.07, 50), same),
                 BroadcastFigure("local-4", 16 << 20, "upstream", Sample(5.7, 0.02, 50), 0.3, memcpy, 1.0, 0.0)]
    arena = [ArenaFigure(2, 8 << 20, "arena upstream", Sample(1.9, 0.1, 50), memcpy, slot_write_ms=0.8,
                         floor_ms=0.3),
             ArenaFigure(2, 8 << 20, "arena testbed", Sample(1.8, 0.1, 50), memcpy, same, same, 0.8, 0.3),
             ArenaFigure(2, 8 << 20, "arena off", Sample(2.5, 0.1, 50), memcpy, floor_ms=0.3)]
    detach = [DetachFigure("logprobs", "testbed", 2048, Sample(0.02, 0.05, 400), Ratio(1.08, 0.05, 1.07, 1.09, 400)),
              DetachFigure("aux_rows", "testbed", 2048, Sample(0.9, 0.05, 400), Ratio(1.2, 0.05, 1.19, 1.21, 400))]
    lines = goals(broadcast=broadcast, arena=arena, detach=detach, meta={"quick": True, "seconds": 70})
    assert lines[0].startswith("broadcast, testbed <= 1.00x upstream") and "**not met** in 1 of 2 cells" in lines[0]
    assert "local-4 16 MiB: 1.05 [1.03-1.07]" in lines[0] and "remote-1" not in lines[0]
    assert "enqueue held 0.40 ms (upstream 0.30)" in lines[0]
    assert "**not met** in 1 of 1 cells; 2 reader(s) 8 MiB: 3.6x (best: arena testbed, 3.6x)" in lines[1]
    assert "floor 0.30 ms and vLLM's slot write 0.80 ms are 2.2x memcpy" in lines[1]
    assert "arena upstream (isolation kept): **met** in all 1 cells" in lines[2]
    assert "**not met** in 1 of 2 shapes: logprobs 1.08, aux_rows 1.20" in lines[3]
    assert lines[4] == "`make bench-quick` under 90 s: **met**, 70 s (the parts' own time, without make's checks)"

"""e2e profiles, workload sizes and the report table."""

from __future__ import annotations

import json
import re

import pytest

from vllm_zerocopy_testbed.config import REPO_ROOT, ConfigError, Executor, TestbedConfig
from vllm_zerocopy_testbed.host_config import (
    CHANNEL_TIMEOUT_ENV,
    DEFAULT_CHANNEL_TIMEOUT_S,
    ClusterSettings,
    e2e_profiles,
    warm_channel_timeout,
)
from vllm_zerocopy_testbed.patches.broadcast import OOB_MIN_BYTES
from vllm_zerocopy_testbed.known import E2E
from vllm_zerocopy_testbed.report import RunReport, TestResult
from vllm_zerocopy_testbed.cluster.compose import ComposeCluster
from vllm_zerocopy_testbed.model import IMAGE_MODELS
from vllm_zerocopy_testbed.workload.catalog import (LARGE_STEP_BYTES, STRUCTURED_CLUSTER, STRUCTURED_REGEXES, EmbedsSizes,
                                                    batched_tokens, concurrent_count, large_step_specs, reference_specs,
                                                    structured_specs, structured_unmet)
from vllm_zerocopy_testbed.workload.embeds import WIRE_BYTES_PER_ROW
from vllm_zerocopy_testbed.workload.requests import Record

pytestmark = pytest.mark.unit


def test_default_profiles_are_both_executors_in_testbed_and_upstream() -> None:
    profiles, chosen = e2e_profiles({})
    assert [str(p) for p in profiles] == ["v2/testbed", "v2/upstream", "cgraph/testbed", "cgraph/upstream"]
    assert not chosen


def test_chosen_modes_are_strict_and_set_both_paths() -> None:
    profiles, chosen = e2e_profiles({"TESTBED_E2E_MODES": "off", "TESTBED_E2E_EXECUTORS": "cgraph"})
    assert chosen and profiles[0].env() == {"TESTBED_EXECUTOR": "cgraph", "TESTBED_BROADCAST": "off",
                                            "TESTBED_DETACH": "off", "TESTBED_INFLIGHT": "off"}


def test_compiled_graph_clusters_after_a_warm_up_get_the_short_channel_bound() -> None:
    """30 s once the run warmed the compile cache, on cgraph only, never over a bound the user set."""
    v2, _, cgraph, _ = e2e_profiles({})[0]
    defaults = ClusterSettings.from_env({}).values
    assert defaults[CHANNEL_TIMEOUT_ENV] == DEFAULT_CHANNEL_TIMEOUT_S  # compose/.env's: what counts as not set
    assert warm_channel_timeout(cgraph, defaults, cache_warm=True) == {CHANNEL_TIMEOUT_ENV: "30"}
    assert warm_channel_timeout(cgraph, defaults, cache_warm=False) == {}
    assert warm_channel_timeout(v2, defaults, cache_warm=True) == {}
    assert warm_channel_timeout(cgraph, {**defaults, CHANNEL_TIMEOUT_ENV: "120"}, cache_warm=True) == {}


def test_bad_executor_or_mode_names_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="use one of: v2, cgraph"):
        e2e_profiles({"TESTBED_E2E_EXECUTORS": "graph"})
    with pytest.raises(ConfigError, match="upstream, off, testbed"):
        e2e_profiles({"TESTBED_E2E_MODES": "of"})


def test_executor_switches() -> None:
    assert Executor.CGRAPH.vllm_env() == {"VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "0",
                                          "VLLM_USE_RAY_COMPILED_DAG_CHANNEL_TYPE": "shm"}
    assert Executor.V2.vllm_env()["VLLM_USE_RAY_V2_EXECUTOR_BACKEND"] == "1"


def test_embeds_sizes_reach_each_transport_path() -> None:
    sizes = EmbedsSizes.for_chunk(2)
    assert sizes.small * WIRE_BYTES_PER_ROW < OOB_MIN_BYTES
    assert OOB_MIN_BYTES < sizes.out_of_band * WIRE_BYTES_PER_ROW < 2 * 1024 * 1024
    assert sizes.overflow * WIRE_BYTES_PER_ROW > 2 * 1024 * 1024
    keys = [s.key for s in reference_specs(sizes, max_num_seqs=8)]
    assert len(keys) == len(set(keys)), "every spec has its own key"


def test_make_e2e_serves_the_structured_suite_on_every_cluster_and_the_defaults_do_not() -> None:
    """The Makefile's e2e exports and the suite's needs are one list: with them, the structured suite
    runs on the profiles' clusters; ``make up`` (compose/.env alone) keeps the small model."""
    exports = dict(re.split(r" \??= ", line.removeprefix("e2e: export ")) for line in (REPO_ROOT / "Makefile")
                   .read_text().splitlines() if line.startswith("e2e: export "))
    assert exports == STRUCTURED_CLUSTER
    assert exports["TESTBED_MODEL"] in IMAGE_MODELS
    defaults = ClusterSettings.from_env({}).values
    assert not structured_unmet({**defaults, **exports})
    unmet = structured_unmet(defaults)
    assert len(unmet) == 3 and unmet[0].startswith("TESTBED_MODEL='/model' (needs '/model-vocab256k')")
    assert structured_unmet({**defaults, **exports, "TESTBED_MAX_MODEL_LEN": "256"}) == [
        "TESTBED_MAX_MODEL_LEN='256' (needs >= 512)"]


def test_the_concurrent_suite_sends_twice_the_sequences_up_to_16() -> None:
    assert [concurrent_count(n) for n in (1, 8, 128)] == [2, 16, 16]
    keys = [s.key for s in reference_specs(EmbedsSizes.for_chunk(2), max_num_seqs=128)]
    assert sum(k.startswith("concurrent/") for k in keys) == 16


def test_report_cell_shows_the_worst_outcome() -> None:
    report = RunReport(profiles=["v2/testbed"])
    report.results += [TestResult("a", "embeds", "v2/testbed", "passed"),
                       TestResult("b", "embeds", "v2/testbed", "failed", message="boom")]
    records = [Record(key="k", suite="embeds", profile="v2/testbed", bound_s=9, latency_s=1.0)]
    table = report.table(records)
    assert "| embeds | FAIL 1 req p50 1.00 s p95 1.00 s |" in table


def test_a_known_failure_is_one_line_per_finding_and_profile_naming_its_tests(tmp_path) -> None:
    """Two tests failing as one finding on one profile: one report line with the finding's folder
    and both tests; another profile gets its own line, and a real failure keeps its own."""
    reason = E2E["cgraph_logprobs"].reason
    report = RunReport(profiles=["cgraph/upstream", "cgraph/off"])
    report.results += [
        TestResult("test_logprobs_k[cgraph/upstream]", "logprobs", "cgraph/upstream", "xfailed", message=reason),
        TestResult("test_smoke[cgraph/upstream]", "smoke", "cgraph/upstream", "xfailed", message=reason),
        TestResult("test_plain[cgraph/upstream]", "plain", "cgraph/upstream", "passed"),
        TestResult("test_smoke[cgraph/off]", "smoke", "cgraph/off", "xfailed", message=reason),
        TestResult("test_embeds[cgraph/off]", "embeds", "cgraph/off", "failed", message="boom"),
    ]
    report.write(tmp_path, [])
    text = (tmp_path / "report.md").read_text()
    known = [line for line in text.splitlines() if "findings/cgraph-raylet-writeacquire" in line]
    assert known == [f"- cgraph/upstream: {reason}; tests: `test_logprobs_k`, `test_smoke`",
                     f"- cgraph/off: {reason}; tests: `test_smoke`"]
    assert "issue" not in text and "- `test_embeds[cgraph/off]` (cgraph/off): boom" in text
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["known"][0] == {"profile": "cgraph/upstream", "finding": "findings/cgraph-raylet-writeacquire",
                                "reason": reason, "tests": ["test_logprobs_k", "test_smoke"]}
    assert len(data["results"]) == 5 and data["cells"], "the per-test results and cells stay as they were"


def test_structured_specs_take_prompt_lengths_and_reject_bad_ones() -> None:
    specs = structured_specs(8, prompt_tokens=(2, 5))
    assert [len(s.prompt_ids) for s in specs] == [2, 3, 4, 5, 2, 3, 4, 5]
    assert [s.regex for s in specs[:4]] == list(STRUCTURED_REGEXES)
    assert len({s.key for s in specs}) == 8
    for bad in ((0, 4), (5, 4)):
        with pytest.raises(ValueError, match="prompt_tokens"):
            structured_specs(4, prompt_tokens=bad)


def test_a_link_rate_must_be_positive() -> None:
    """``ComposeCluster.shape`` refuses a rate that would stop the link, before touching anything."""
    with pytest.raises(ValueError, match="rate_mbit"):
        ComposeCluster().shape("head", 0)


def test_large_steps_pass_the_socket_buffers_and_say_what_they_need() -> None:
    specs = large_step_specs(max_num_seqs=8, max_model_len=8192)  # what make faults sets
    (spec,) = specs
    assert len(spec.embeds) == 8, "one part per sequence slot"
    assert sum(e.wire_bytes for e in spec.embeds[1:]) >= LARGE_STEP_BYTES, "seven parts (one step) carry 16 MiB"
    assert batched_tokens(specs) == sum(len(e.ids) for e in spec.embeds) <= 40960  # make faults' budget
    with pytest.raises(ValueError, match="TESTBED_MAX_NUM_SEQS or TESTBED_MAX_MODEL_LEN"):
        large_step_specs(max_num_seqs=8, max_model_len=4608)


@pytest.mark.parametrize("args, tokens", [("", None), ("--enforce-eager", None), ("--max-num-batched-tokens 36864", 36864),
                                          ("--max-num-batched-tokens=512 --enforce-eager", 512)])
def test_the_batch_budget_is_read_from_the_serve_args(args: str, tokens: int | None) -> None:
    assert ClusterSettings.from_env({"TESTBED_SERVE_ARGS": args}).max_num_batched_tokens == tokens


def test_a_bad_batch_budget_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="--max-num-batched-tokens needs a number"):
        ClusterSettings.from_env({"TESTBED_SERVE_ARGS": "--max-num-batched-tokens lots"}).max_num_batched_tokens


def test_node_environment_is_name_value_words_and_an_empty_value_is_refused() -> None:
    settings = ClusterSettings.from_env({"TESTBED_NODE_ENV": " MALLOC_ARENA_MAX=2  MALLOC_MMAP_THRESHOLD_=131072 "})
    assert settings.node_env == {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "131072"}
    assert ClusterSettings.from_env({}).node_env == {}
    for bad in ("MALLOC_MMAP_THRESHOLD_=", "MALLOC_ARENA_MAX", "2X=1", "A-B=1"):
        with pytest.raises(ConfigError, match="TESTBED_NODE_ENV: .* is not NAME=VALUE"):
            ClusterSettings.from_env({"TESTBED_NODE_ENV": bad})


@pytest.mark.parametrize("raw", ["-1", "soon", "nan"])
def test_a_bad_heap_probe_period_is_a_clear_error(raw: str) -> None:
    with pytest.raises(ConfigError, match="TESTBED_HEAP_PROBE_S=.* seconds >= 0"):
        TestbedConfig.from_env({"TESTBED_HEAP_PROBE_S": raw})
    assert TestbedConfig.from_env({"TESTBED_HEAP_PROBE_S": "0"}).heap_probe_s == 0

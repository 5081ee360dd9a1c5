"""One completion with logprobs and one with prompt_embeds through the real cluster."""

from __future__ import annotations

import re

import pytest
from openai import OpenAI, OpenAIError

from vllm_zerocopy_testbed import vllm_source
from vllm_zerocopy_testbed.cluster.placement import Topology
from vllm_zerocopy_testbed.model import build, model_dir
from vllm_zerocopy_testbed.node import warmup
from live.suite import MODEL_SPEC, MODES_CHOSEN, REPORT, REQUEST_TIMEOUT_S
from vllm_zerocopy_testbed.workload.embeds import encode, rows_for

pytestmark = [pytest.mark.e2e, pytest.mark.smoke, pytest.mark.suite("smoke"), pytest.mark.timeout(1500)]

PROMPT = "Pipeline parallel stages pass hidden states"


def _embeds_of(prompt: str) -> tuple[list[int], str]:
    """Return the prompt's token ids and base64 of ``torch.save`` of their embedding rows."""
    from transformers import AutoTokenizer

    directory = model_dir(MODEL_SPEC)
    build(directory, MODEL_SPEC)  # same bytes as the image's model at TESTBED_MODEL (deterministic builder)
    ids = AutoTokenizer.from_pretrained(directory)(prompt)["input_ids"]
    return ids, encode(rows_for(ids, spec=MODEL_SPEC))


def _create(cluster, client: OpenAI, **request):
    """One completion; a failed one fails the test quoting why the server failed it (the engine's death
    on cgraph/upstream when this is a run's first logprobs request: ``make test-smoke``), as a
    workload's failed request does, so that a known failure matches only its own cause."""
    try:
        return client.completions.create(**request)
    except OpenAIError as exc:
        what = f"{type(exc).__name__}: {exc}"
        pytest.fail(cluster.died("smoke", what) or f"{what}; server log: {cluster.evidence(3)}")


@pytest.mark.known("cgraph_logprobs")
def test_logprobs_and_prompt_embeds_answer_the_same(cluster) -> None:
    if cluster.dead:
        pytest.fail(f"not run: {cluster.dead}")
    client = OpenAI(base_url=cluster.backend.base_url, api_key="testbed", timeout=REQUEST_TIMEOUT_S, max_retries=0)
    model = cluster.settings["TESTBED_SERVED_MODEL"]
    by_text = _create(cluster, client, model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=5)
    choice = by_text.choices[0]
    assert len(choice.logprobs.tokens) == 8
    assert all(len(top) == 5 for top in choice.logprobs.top_logprobs), "5 logprobs per position"

    _, embeds = _embeds_of(PROMPT)
    by_embeds = _create(cluster, client, model=model, prompt=None, max_tokens=8, temperature=0, logprobs=5,
                        extra_body={"prompt_embeds": embeds})
    assert by_embeds.choices[0].logprobs.tokens == choice.logprobs.tokens
    assert by_embeds.choices[0].logprobs.token_logprobs == choice.logprobs.token_logprobs


def test_each_stage_runs_on_its_own_node(cluster) -> None:
    """TP ranks share a node (shm all-reduce); PP stages cross nodes (the transport under test): the
    ranks per node are those ``Topology`` derives from PP, TP and the node count."""
    if cluster.settings.device_profile == "gpu" or cluster.settings.workers == 0:
        pytest.skip("ranks are logged by the testbed's CPU communicator, and one node has nothing to cross")
    blind = cluster.backend.blind_to("placement")
    if blind:
        pytest.skip(blind)
    topology = Topology.from_settings(cluster.settings.values)
    placement = cluster.backend.placement()
    assert not topology.mismatches(placement), (topology.mismatches(placement), placement)
    nodes = {stage: {p.node for p in placement if p.pp_rank == stage} for stage in range(topology.pp)}
    assert all(len(n) == 1 for n in nodes.values()), f"a stage spans nodes: {nodes}"


def test_every_process_runs_the_profile_modes(cluster) -> None:
    """API server, engine and every Ray worker log the modes of the profile under test.

    On an external cluster only the Ray workers' lines can be read (its dashboard); where no
    modes were named (``MODES=``), they must agree with each other, and say what it runs."""
    blind = cluster.backend.blind_to("mode-lines")
    if blind:
        pytest.skip(blind)
    lines = cluster.backend.mode_lines()
    want = (f"broadcast={cluster.profile.broadcast.value} detach={cluster.profile.detach.value} "
            f"inflight={cluster.profile.detach.value}")
    if not cluster.backend.owned and not lines:
        pytest.skip("the external cluster's Ray workers log no testbed modes line: a vLLM without the "
                    "testbed's plugin runs what it installed")
    if not cluster.backend.owned and not MODES_CHOSEN:
        want = re.search(r"broadcast=\S+ detach=\S+ inflight=\S+", lines[0])[0]
        REPORT.notes.append(f"{cluster.profile}: the external cluster's Ray workers run {want}")
    tp, pp = int(cluster.settings["TESTBED_TP"]), int(cluster.settings["TESTBED_PP"])
    workers = [line for line in lines if "role=ray-worker" in line]
    assert len({line.split("pid=")[1].split()[0] for line in workers}) >= tp * pp, lines
    assert lines and all(want in line for line in lines), f"want {want!r} in every line: {lines}"
    if cluster.backend.owned:  # the image runs the vLLM this run names (VLLM=, the report's header)
        code = f"vllm={vllm_source.running_line()}"
        assert all(line.endswith(code) for line in lines), f"want {code!r} in every line (VLLM=...): {lines}"


def test_a_warm_compile_cache_is_loaded_not_rebuilt(cluster) -> None:
    """What the first requests compile is kept (compose: a named volume across `make down`);
    a start that found it there builds nothing again. A start with an empty cache fills it."""
    blind = cluster.backend.blind_to("engine-log")
    if blind:
        pytest.skip(blind)
    found = [m for m in map(warmup.CACHE_LINE.search, cluster.backend.logs().splitlines()) if m]
    if not found:
        pytest.skip("this backend's start-up logs no compile-cache line (only the compose head's warm-up does)")
    before, built = int(found[-1]["before"]), int(found[-1]["built"])
    if before == 0:
        pytest.skip(f"the first start on an empty compile cache: it built {built} precompiled header(s) for later")
    assert built == 0, (f"{built} precompiled header(s) built again although {before} were in the cache "
                        f"(a cache key changed, or the cache is not where torch looks): {found[-1][0]}")

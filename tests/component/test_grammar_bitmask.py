"""The engine's own buffer reuse through a real MessageQueue: the grammar bitmask
(findings/53217-oob-send-race).

vLLM's ``StructuredOutputManager`` keeps one bitmask tensor, refills it in place for each
batch it schedules and broadcasts ``bitmask[:n].numpy()`` (a view) inside the
``sample_tokens`` RPC. With a batch queue (pipeline parallel) the next batch is filled
while the previous one's RPC may still be on its way to a remote rank. Here xgrammar fills
the rows as the manager does (its own matchers and ``fill_next_token_bitmask``), a remote
reader is stopped while batch A's bitmask is sent, and batch B's grammars then refill the
same memory: the reader must still get A's masks.

1024 rows of a 262144-token vocabulary (32 KiB each) is the bitmask of
``--max-num-seqs 1024`` with a Gemma-size vocabulary: 32 MiB, far past the socket
buffers, so a stopped reader leaves it in ZMQ's hands. End to end on this machine the
engine never refilled it while ZMQ held it (docs/design.md, "The send race end to end").
"""

from __future__ import annotations

import threading

import pytest

from vllm_zerocopy_testbed.harness.message_queue import MessageQueueHarness, QueueTopology, describe
from vllm_zerocopy_testbed.model import LARGE_VOCAB, TinyModelSpec, build_tokenizer

pytestmark = pytest.mark.component

ROWS = 1024


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    """An xgrammar compiler over the large-vocabulary model's tokenizer (what vLLM's backend builds)."""
    xgr = pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(TinyModelSpec(vocab_size=LARGE_VOCAB), out)
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(out), vocab_size=LARGE_VOCAB)
    return xgr.GrammarCompiler(info)


def _fill(compiler, bitmask, regex: str, rows: int) -> None:
    grammar = compiler.compile_regex(regex)
    import xgrammar as xgr

    for row in range(rows):
        xgr.GrammarMatcher(grammar).fill_next_token_bitmask(bitmask, row)


def test_a_refilled_grammar_bitmask_never_reaches_a_stopped_reader(compiler, broadcast_mode, expect) -> None:
    expect("race_free_ndarray", broadcast_mode)
    import xgrammar as xgr

    persistent = xgr.allocate_token_bitmask(ROWS, LARGE_VOCAB)  # the manager's, allocated once
    _fill(compiler, persistent, "[0-9]{12}", ROWS)  # batch A: digits only
    batch_a = persistent[:ROWS].numpy()  # what grammar_bitmask() returns: a view
    expected = describe({"grammar_bitmask": batch_a.copy()})
    assert batch_a.nbytes == 32 << 20
    with MessageQueueHarness(QueueTopology(local_readers=0, remote_readers=1), broadcast_mode) as harness:
        harness.pause_readers()
        resume = threading.Timer(3.0, harness.resume_readers)
        resume.start()
        try:
            harness.send({"grammar_bitmask": batch_a})  # sample_tokens(grammar_output), non-blocking
            _fill(compiler, persistent, "(yes|no)( (yes|no)){5}", ROWS)  # batch B, scheduled next
        finally:
            resume.cancel()
            harness.resume_readers()
        reports = harness.collect()
    assert reports[1]["grammar_bitmask"].digest == expected["grammar_bitmask"].digest, (
        "the remote reader got batch B's masks in batch A's sample_tokens (upstream PR 53217)")

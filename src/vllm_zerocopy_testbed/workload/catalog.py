"""The named workloads: deterministic request lists, the same for the cluster and the reference.

Sizes are in rows of the model's hidden size; the server casts every dtype to
fp32, so the transport carries ``rows x 512`` bytes whatever dtype was sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from vllm_zerocopy_testbed.model import TinyModelSpec
from vllm_zerocopy_testbed.patches.broadcast import OOB_MIN_BYTES
from vllm_zerocopy_testbed.workload.embeds import DTYPES, WIRE_BYTES_PER_ROW, token_ids
from vllm_zerocopy_testbed.workload.requests import CompletionSpec, Embeds

MAX_TOKENS = 8
LOGPROBS_KS = (1, 2, 5, 10, 20)
PROMPT_LOGPROBS_KS = (1, 5)
# The MessageQueue message carries scheduler fields beside the tensor; this many rows
# past the chunk make sure the whole message overflows.
_OVERFLOW_MARGIN_ROWS = 104


@dataclass(frozen=True)
class EmbedsSizes:
    """Rows per transport path: in the ring and in band, out of band, and past the ring chunk."""

    small: int
    out_of_band: int
    overflow: int

    @classmethod
    def for_chunk(cls, chunk_mib: int) -> "EmbedsSizes":
        return cls(small=32,
                   out_of_band=OOB_MIN_BYTES // WIRE_BYTES_PER_ROW + 52,  # just over 1 MiB
                   overflow=chunk_mib * 1024 * 1024 // WIRE_BYTES_PER_ROW + _OVERFLOW_MARGIN_ROWS)

    def items(self) -> list[tuple[str, int]]:
        return [("small", self.small), ("oob", self.out_of_band), ("overflow", self.overflow)]


def embeds_specs(sizes: EmbedsSizes, dtypes: tuple[str, ...] = tuple(DTYPES),
                 spec: TinyModelSpec = TinyModelSpec()) -> list[CompletionSpec]:
    """prompt_embeds per dtype and size (rows of ``spec``'s model, the one served), each with its
    token-id twin (``ids/<size>``)."""
    specs = []
    for size, rows in sizes.items():
        ids = tuple(token_ids(rows, seed=rows))
        specs.append(CompletionSpec(f"ids/{size}", prompt_ids=ids, max_tokens=MAX_TOKENS, logprobs=5))
        specs += [CompletionSpec(f"embeds/{dtype}/{size}", embeds=(Embeds(ids, dtype, spec),), max_tokens=MAX_TOKENS,
                                 logprobs=5) for dtype in dtypes]
    return specs


def plain_specs(sizes: EmbedsSizes, spec: TinyModelSpec = TinyModelSpec()) -> list[CompletionSpec]:
    """Token ids and fp32 embeds of every size without logprobs: what the compiled-graph executor answers."""
    specs = []
    for size, rows in sizes.items():
        ids = tuple(token_ids(rows, seed=rows))
        specs += [CompletionSpec(f"plain/ids/{size}", prompt_ids=ids, max_tokens=MAX_TOKENS),
                  CompletionSpec(f"plain/embeds/{size}", embeds=(Embeds(ids, spec=spec),), max_tokens=MAX_TOKENS)]
    return specs


def embeds_batch_specs(parts: int = 3, spec: TinyModelSpec = TinyModelSpec()) -> list[CompletionSpec]:
    """Several prompt_embeds in one request, and each part's token ids alone."""
    ids = [tuple(token_ids(24 + 8 * i, seed=100 + i)) for i in range(parts)]
    batch = CompletionSpec("embeds/batch", embeds=tuple(Embeds(i, spec=spec) for i in ids), max_tokens=MAX_TOKENS,
                           logprobs=5)
    return [batch, *(CompletionSpec(f"ids/batch/{n}", prompt_ids=i, max_tokens=MAX_TOKENS, logprobs=5)
                     for n, i in enumerate(ids))]


def logprobs_specs(max_tokens: int = 16) -> list[CompletionSpec]:
    """logprobs 1..20 (ids keep all k: --return-tokens-as-token-ids)."""
    return [CompletionSpec(f"logprobs/k{k}", prompt_ids=tuple(token_ids(16, seed=k)), max_tokens=max_tokens,
                           logprobs=k) for k in LOGPROBS_KS]


def prompt_logprobs_specs() -> list[CompletionSpec]:
    return [CompletionSpec(f"prompt-logprobs/k{k}", prompt_ids=tuple(token_ids(12, seed=50 + k)),
                           max_tokens=MAX_TOKENS, logprobs=5, prompt_logprobs=k) for k in PROMPT_LOGPROBS_KS]


def stream_specs() -> list[CompletionSpec]:
    """Streamed twins of ``logprobs/k5``: the chunks must add up to the same answer."""
    base = logprobs_specs()[LOGPROBS_KS.index(5)]
    return [CompletionSpec("stream/k5", prompt_ids=base.prompt_ids, max_tokens=base.max_tokens, logprobs=5,
                           stream=True)]


# The concurrent suite sends twice the default --max-num-seqs (8) at once, or twice a smaller one:
# with the structured suite's 128 sequences, 256 logprobs requests over a 262144-token vocabulary
# would cost the reference ~1 min on its own.
CONCURRENT_MAX = 16


def concurrent_count(max_num_seqs: int) -> int:
    """How many requests the concurrent suite sends at once to a server of ``max_num_seqs``."""
    return min(2 * max_num_seqs, CONCURRENT_MAX)


def concurrent_specs(count: int) -> list[CompletionSpec]:
    """``count`` distinct logprobs requests meant to be in flight together."""
    return [CompletionSpec(f"concurrent/{i}", prompt_ids=tuple(token_ids(8 + i % 7, seed=200 + i)),
                           max_tokens=MAX_TOKENS, logprobs=5) for i in range(count)]


# Structured outputs: grammars whose masks share no token, so a request sampled with another
# request's bitmask row (the send race on the grammar bitmask) breaks its own regex.
STRUCTURED_REGEXES = ("[0-9]{12}", "(red|green|blue)( (red|green|blue)){3}", "[n-z]{12}", "(yes|no)( (yes|no)){5}")


# What the structured suite needs of a cluster: the variant whose grammar bitmask rows are 32 KiB
# (262144 tokens), room for two pipeline batches of >= 32 structured rows (a bitmask >= 1 MiB: out of
# band), the MessageQueue timeline it judges, and its prompts (2-6 tokens) plus 32 answer tokens.
STRUCTURED_CLUSTER = {"TESTBED_MODEL": "/model-vocab256k", "TESTBED_MAX_NUM_SEQS": "128", "TESTBED_MQ_TIMELINE": "1"}
STRUCTURED_MIN_MODEL_LEN = 512


def structured_unmet(settings: Mapping[str, str]) -> list[str]:
    """What a cluster started with ``settings`` lacks for the structured suite (empty: it can run there).

    ``make e2e`` starts every cluster so (Makefile), and the suite then runs first on each V2 profile's
    own cluster; with other settings it brings up clusters of its own (``STRUCTURED_CLUSTER``)."""
    unmet = [f"{key}={settings.get(key, '')!r} (needs {value!r})" for key, value in STRUCTURED_CLUSTER.items()
             if settings.get(key, "").strip().rstrip("/") != value]
    length = settings.get("TESTBED_MAX_MODEL_LEN", "")
    if not length.isdigit() or int(length) < STRUCTURED_MIN_MODEL_LEN:
        unmet.append(f"TESTBED_MAX_MODEL_LEN={length!r} (needs >= {STRUCTURED_MIN_MODEL_LEN})")
    return unmet


def structured_specs(count: int, max_tokens: int = 32,
                     prompt_tokens: tuple[int, int] = (6, 10)) -> list[CompletionSpec]:
    """``count`` distinct regex-constrained requests, the grammars taking turns, prompts of
    ``prompt_tokens`` (first to last, inclusive) tokens."""
    low, high = prompt_tokens
    if not 0 < low <= high:
        raise ValueError(f"prompt_tokens must be 0 < low <= high, got {prompt_tokens}")
    return [CompletionSpec(f"structured/{i}", prompt_ids=tuple(token_ids(low + i % (high - low + 1), seed=400 + i)),
                           max_tokens=max_tokens, regex=STRUCTURED_REGEXES[i % len(STRUCTURED_REGEXES)])
            for i in range(count)]


def reference_specs(sizes: EmbedsSizes, max_num_seqs: int, spec: TinyModelSpec = TinyModelSpec()) -> list[CompletionSpec]:
    """Every spec the cluster suites compare with the single-process reference, prompt_embeds of
    ``spec``'s model (the one served)."""
    return [*plain_specs(sizes, spec), *embeds_specs(sizes, spec=spec), *embeds_batch_specs(spec=spec), *logprobs_specs(),
            *prompt_logprobs_specs(), *stream_specs(), *concurrent_specs(concurrent_count(max_num_seqs))]


# A scheduler step that carries this much prompt_embeds is past the socket buffers of a TCP
# reader (here: 4 MiB send + the receive window): ZMQ cannot finish its send to a frozen one.
LARGE_STEP_BYTES = 16 * 1024 * 1024


def large_step_specs(max_num_seqs: int, max_model_len: int, step_bytes: int = LARGE_STEP_BYTES) -> list[CompletionSpec]:
    """One request of ``max_num_seqs`` prompt_embeds, each step that admits them sending at least
    ``step_bytes`` to the worker node (a new request's whole prompt_embeds goes with it).

    Measured (MessageQueue timeline, two clients streaming such batches): the steps carry 1 and
    ``max_num_seqs - 1`` of them in turn. The first part of a batch is admitted alone as the
    engine picks it up, the rest a step later; so the batch's parts finish a step apart and the
    next batch is admitted the same way. Sized so that ``max_num_seqs - 1`` parts carry
    ``step_bytes``; the engine needs ``--max-num-batched-tokens`` >= ``batched_tokens(...)``.
    Raises ValueError where the parts cannot fit in ``max_model_len``."""
    if max_num_seqs < 2:
        raise ValueError(f"a large step needs TESTBED_MAX_NUM_SEQS >= 2, got {max_num_seqs}")
    rows = -(-step_bytes // ((max_num_seqs - 1) * WIRE_BYTES_PER_ROW))
    if rows + MAX_TOKENS > max_model_len:
        raise ValueError(f"{step_bytes} bytes in {max_num_seqs - 1} prompts need {rows} rows each, past max_model_len "
                         f"{max_model_len}: raise TESTBED_MAX_NUM_SEQS or TESTBED_MAX_MODEL_LEN")
    parts = tuple(Embeds(tuple(token_ids(rows, seed=300 + i))) for i in range(max_num_seqs))
    return [CompletionSpec(f"embeds/step-{step_bytes >> 20}mib", embeds=parts, max_tokens=4, logprobs=2)]


def batched_tokens(specs: list[CompletionSpec]) -> int:
    """The most prompt tokens one spec brings: what one scheduler step must take to admit it whole."""
    return max(sum(len(e.ids) for e in spec.embeds) + len(spec.prompt_ids or ()) for spec in specs)

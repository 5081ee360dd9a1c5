"""One completion request: what to send (``CompletionSpec``) and what came back (``Record``).

Every request goes through the ``openai`` client with its own timeout; a timeout,
an HTTP error or a dropped connection is recorded, never raised, so that the
checkers judge the whole history.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import openai

from vllm_zerocopy_testbed.model import TinyModelSpec
from vllm_zerocopy_testbed.workload import embeds as embeds_mod


@dataclass(frozen=True)
class Embeds:
    """A prompt_embeds tensor: the rows of ``spec``'s model for ``ids``, sent in ``dtype``."""

    ids: tuple[int, ...]
    dtype: str = "float32"
    spec: TinyModelSpec = TinyModelSpec()

    @property
    def wire_bytes(self) -> int:
        """Bytes of the tensor once the server has cast it to fp32 (what the transport carries)."""
        return len(self.ids) * self.spec.hidden_size * 4


@functools.lru_cache(maxsize=64)
def _encoded(part: Embeds) -> str:
    return embeds_mod.encode(embeds_mod.rows_for(list(part.ids), part.dtype, part.spec))


@dataclass(frozen=True)
class CompletionSpec:
    """A deterministic completion request; ``key`` names it across runs, modes and servers."""

    key: str
    prompt_ids: tuple[int, ...] | None = None
    embeds: tuple[Embeds, ...] = ()
    max_tokens: int = 8
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stream: bool = False
    # Structured output: the answer must match this regex in full (vLLM's grammar bitmask path).
    regex: str | None = None

    def body(self) -> dict[str, Any]:
        """Return the keyword arguments of ``client.completions.create`` (without model)."""
        extra: dict[str, Any] = {}
        if self.embeds:
            encoded = [_encoded(part) for part in self.embeds]
            extra["prompt_embeds"] = encoded[0] if len(encoded) == 1 else encoded
        if self.prompt_logprobs is not None:
            extra["prompt_logprobs"] = self.prompt_logprobs
        if self.regex is not None:
            extra["structured_outputs"] = {"regex": self.regex}
        args: dict[str, Any] = {
            "prompt": list(self.prompt_ids) if self.prompt_ids is not None else None,
            "max_tokens": self.max_tokens, "temperature": 0, "stream": self.stream,
            "extra_body": extra,
        }
        if self.logprobs is not None:
            args["logprobs"] = self.logprobs
        if self.stream:  # a last chunk with the token count: tokens/s without logprobs
            args["stream_options"] = {"include_usage": True}
        return args


@dataclass
class Record:
    """What one request did: timings, outcome, and the answer's tokens and logprobs."""

    key: str
    suite: str
    profile: str
    bound_s: float
    started: float = 0.0
    latency_s: float = 0.0
    ttft_s: float | None = None
    status: str = "ok"  # ok | error | timeout
    http_status: int | None = None
    error: str | None = None
    completion_tokens: int | None = None  # from the answer's usage
    # The single-process reference's latency for the same request, sent just before this one
    # (``Runner.run(paired=...)``): both under the same load, so their ratio is the cluster's cost.
    reference_latency_s: float | None = None
    # Per choice: {"tokens": [ids], "token_logprobs": [...], "top_logprobs": [{id: lp}], "prompt_logprobs": ...}
    choices: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _token_id(token: str) -> int:
    # --return-tokens-as-token-ids: tokens come back as "token_id:<n>"
    return int(token.rsplit(":", 1)[1]) if token.startswith("token_id:") else -1


def _top(entries: list[dict[str, float]] | None) -> list[dict[str, float]]:
    return [{str(_token_id(k)): v for k, v in (entry or {}).items()} for entry in entries or []]


def _choice(choice: Any) -> dict[str, Any]:
    logprobs = choice.logprobs
    out: dict[str, Any] = {"text": choice.text, "finish_reason": choice.finish_reason}
    if logprobs is not None:
        out["tokens"] = [_token_id(t) for t in logprobs.tokens or []]
        out["token_logprobs"] = list(logprobs.token_logprobs or [])
        out["top_logprobs"] = _top(logprobs.top_logprobs)
    extra = getattr(choice, "model_extra", None) or {}
    if extra.get("prompt_logprobs") is not None:
        out["prompt_logprobs"] = extra["prompt_logprobs"]
    return out


def _merge_stream(chunks: list[Any]) -> list[dict[str, Any]]:
    merged: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            part = _choice(choice)
            into = merged.setdefault(choice.index, {"text": "", "finish_reason": None})
            into["text"] += part["text"] or ""
            into["finish_reason"] = part["finish_reason"] or into["finish_reason"]
            for name in ("tokens", "token_logprobs", "top_logprobs"):
                if name in part:
                    into.setdefault(name, []).extend(part[name])
            if "prompt_logprobs" in part:
                into["prompt_logprobs"] = part["prompt_logprobs"]
    return [merged[i] for i in sorted(merged)]


def send(client: openai.OpenAI, model: str, spec: CompletionSpec, *, suite: str, profile: str,
         timeout: float) -> Record:
    """Send ``spec`` with a bound of ``timeout`` seconds; return its record (never raises for the server)."""
    record = Record(key=spec.key, suite=suite, profile=profile, bound_s=timeout, started=time.time())
    start = time.monotonic()
    try:
        response = client.with_options(timeout=timeout, max_retries=0).completions.create(
            model=model, **spec.body())
        if spec.stream:
            chunks = []
            for chunk in response:
                if record.ttft_s is None and any(c.text for c in chunk.choices):
                    record.ttft_s = time.monotonic() - start
                chunks.append(chunk)
                if getattr(chunk, "usage", None) is not None:
                    record.completion_tokens = chunk.usage.completion_tokens
                if time.monotonic() - start > timeout:
                    raise openai.APITimeoutError(request=None)  # type: ignore[arg-type]
            record.choices = _merge_stream(chunks)
        else:
            record.choices = [_choice(c) for c in sorted(response.choices, key=lambda c: c.index)]
            if response.usage is not None:
                record.completion_tokens = response.usage.completion_tokens
    except openai.APITimeoutError:
        record.status, record.error = "timeout", f"no answer within {timeout:.0f} s"
    except openai.APIStatusError as exc:
        record.status, record.http_status = "error", exc.status_code
        record.error = str(exc.message)[:500]
    except openai.APIConnectionError as exc:
        record.status, record.error = "error", f"connection: {exc.__cause__ or exc}"[:500]
    record.latency_s = time.monotonic() - start
    if record.ttft_s is None and record.ok:
        record.ttft_s = record.latency_s
    return record


@dataclass(frozen=True)
class Event:
    """Something done to the cluster during a workload (a nemesis applied or healed), in the
    same history as the requests: checkers read fault times from here."""

    at: float  # epoch seconds, as ``Record.started``
    kind: str  # the nemesis's name
    phase: str  # apply | heal | failed (the nemesis itself raised)
    target: str  # the node
    profile: str
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class History:
    """Every record and event of a session, appended from any thread; saved as JSON by the report."""

    def __init__(self) -> None:
        self._records: list[Record] = []
        self._events: list[Event] = []
        self._lock = threading.Lock()

    def add(self, record: Record) -> Record:
        with self._lock:
            self._records.append(record)
        return record

    def add_event(self, event: Event) -> Event:
        with self._lock:
            self._events.append(event)
        return event

    def records(self, *, profile: str | None = None, suite: str | None = None) -> list[Record]:
        with self._lock:
            return [r for r in self._records
                    if (profile is None or r.profile == profile) and (suite is None or r.suite == suite)]

    def events(self, *, profile: str | None = None, kind: str | None = None) -> list[Event]:
        with self._lock:
            return [e for e in self._events
                    if (profile is None or e.profile == profile) and (kind is None or e.kind == kind)]

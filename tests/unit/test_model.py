"""The tiny model builds to the same bytes every time, with no hub access."""

from __future__ import annotations

import json

import pytest

from vllm_zerocopy_testbed.model import TinyModelSpec, build, checksum

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def test_two_builds_are_byte_identical(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    first, second = build(tmp_path / "a"), build(tmp_path / "b")
    assert first == second == checksum(tmp_path / "a")
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    spec = TinyModelSpec()
    assert (config["hidden_size"], config["head_dim"], config["num_hidden_layers"]) == (128, 32, 4)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (4, 2, spec.vocab_size)


def test_tokenizer_round_trips_text(tmp_path) -> None:
    from transformers import AutoTokenizer

    build(tmp_path / "m")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "m")
    text = "Pipeline parallel stages pass hidden states."
    ids = tokenizer(text)["input_ids"]
    assert max(ids) < 512 and tokenizer.decode(ids, skip_special_tokens=True) == text

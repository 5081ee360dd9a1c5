"""The tiny model builds to the same bytes every time, with no hub access."""

from __future__ import annotations

import json
import re

import pytest

from vllm_zerocopy_testbed.config import REPO_ROOT
from vllm_zerocopy_testbed.model import IMAGE_MODELS, LARGE_VOCAB, TinyModelSpec, build, checksum, spec_for

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


def test_the_host_serves_the_variant_the_node_image_has_at_each_path() -> None:
    """The reference and the local backend build what ``TESTBED_MODEL`` names in the node image: the
    Dockerfile's ``model --out PATH [--vocab-size N]`` lines and ``IMAGE_MODELS`` list the same variants."""
    dockerfile = (REPO_ROOT / "images" / "node" / "Dockerfile").read_text()
    built = {m["path"]: TinyModelSpec(vocab_size=int(m["vocab"] or TinyModelSpec.vocab_size))
             for m in re.finditer(r"vllm_zerocopy_testbed\.model --out (?P<path>\S+)(?: --vocab-size (?P<vocab>\d+))?",
                                  dockerfile)}
    assert built == IMAGE_MODELS
    assert spec_for("/model-vocab256k") == TinyModelSpec(vocab_size=LARGE_VOCAB)
    assert spec_for("/model/") == spec_for("/model") == TinyModelSpec()
    assert spec_for("/somewhere/else") == TinyModelSpec()  # what a host server always served

"""The warm-up's compile-cache line: what was in the cache at start, what had to be built."""

from __future__ import annotations

import os

import pytest

from vllm_zerocopy_testbed.node import warmup

pytestmark = pytest.mark.unit


def test_a_header_kept_is_loaded_and_a_new_or_rebuilt_one_is_built(tmp_path) -> None:
    kept = tmp_path / "a.h.gch"
    kept.write_bytes(b"pch")
    before = warmup.headers(tmp_path)
    (tmp_path / "b.h.gch").write_bytes(b"pch")  # built now
    line = warmup.cache_report(before, warmup.headers(tmp_path))
    assert warmup.CACHE_LINE.search(line).groupdict() == {"before": "1", "built": "1"}
    stat = kept.stat()
    os.utime(kept, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # rebuilt in place
    assert warmup.CACHE_LINE.search(warmup.cache_report(before, warmup.headers(tmp_path)))["built"] == "2"
    assert warmup.cache_report(before, before).endswith("1 precompiled headers at start, 0 built now")


def test_no_folder_is_an_empty_cache(tmp_path) -> None:
    assert warmup.headers(tmp_path / "missing") == {}

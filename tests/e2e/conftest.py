"""The cluster every e2e test talks to: brought up once per session, always brought down."""

from __future__ import annotations

import pytest

from vllm_zerocopy_testbed.cluster.compose import ComposeCluster


@pytest.fixture(scope="session")
def cluster():
    with ComposeCluster(up_timeout=600) as running:
        yield running

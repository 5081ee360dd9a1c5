"""The cluster every e2e test talks to: brought up once per session.

``TESTBED_CLUSTER=compose`` (default) or ``local`` (Ray nodes as processes on 127.0.0.x).
A cluster that was already up and healthy (``make up``) is used and left up;
one the session started is always brought down, also on failure.
"""

from __future__ import annotations

import pytest

from vllm_zerocopy_testbed.cluster import cluster_from_env


@pytest.fixture(scope="session")
def cluster():
    backend = cluster_from_env(up_timeout=600)
    if backend.is_running():
        yield backend
        return
    with backend as running:
        yield running

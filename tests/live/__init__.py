"""The pytest glue of the live-cluster suites (``tests/e2e``, ``tests/faults``), kept out of the
library: ``plugin`` holds the fixtures and hooks (loaded once, by ``tests/conftest.py``),
``suite`` the run-wide objects they hand to tests (``from live.suite import ...``)."""

"""What runs inside a node container (or beside the local backend's nodes): the API server's
command line, the warm-up, the head's watchdog, the wait for Ray nodes. Each is also a CLI
(``python -m vllm_zerocopy_testbed.node.<name>``) for ``images/node/testbed-head``; none
imports the host-side cluster control in ``cluster/``."""

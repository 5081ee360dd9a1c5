"""vLLM entry points: the general plugin (modes) and the CPU platform plugin (Ray on CPU)."""

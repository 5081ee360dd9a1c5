"""Workloads: what clients send through the OpenAI API, and the history they record."""

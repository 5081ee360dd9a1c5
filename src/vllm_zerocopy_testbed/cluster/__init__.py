"""Clusters the suites run against: local Ray processes now, Docker Compose next."""

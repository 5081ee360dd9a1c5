"""make soak: a long mixed stream on one cluster, per-minute samples per node, growth rates against budgets."""

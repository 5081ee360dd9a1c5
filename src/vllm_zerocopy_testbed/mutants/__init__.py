"""``make mutants``: plant realistic regressions of the code under test, one at a time, and see which tests catch them."""

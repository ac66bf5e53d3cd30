"""Whole-product suites: the error contract, the fuzz campaign's slice and regressions, golden and real plans,
readable numbers, layering and packaging."""

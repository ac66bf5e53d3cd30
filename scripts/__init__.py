"""Maintained tools (run as ``PYTHONPATH=. python3 scripts/NAME.py``); one-off GPU experiments are in experiments/."""

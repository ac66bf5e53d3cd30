"""Tests of planner/, one file per module: tests/planner/test_<module>.py (test_<module>_<aspect>.py for more)."""

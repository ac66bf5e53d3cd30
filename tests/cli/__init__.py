"""Tests of offload_plan/ itself: the application (app.py) and the commands' own logic (test_<command>.py)."""

"""The commands that read plans: ``show``, ``diff``, ``check`` and ``export``."""

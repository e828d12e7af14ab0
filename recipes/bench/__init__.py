"""The link benchmark of ``recipes/benchmark.py``: ``netns`` (the link), ``measure`` (one rank), ``report``, ``cli``."""

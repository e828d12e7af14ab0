"""The link benchmark of ``recipes/benchmark.py``: ``netns`` (the link), ``measure`` (one rank), ``cli`` (the rest)."""

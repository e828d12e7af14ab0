"""The communication benchmark of ``recipes/benchmark.py``, one concern per module.

- :mod:`bench.cli`: command line, and the parent process that makes the link, starts the ranks with
  ``torchrun`` (inside the network namespace) and writes the report.
- :mod:`bench.netns`: the rate-limited link: a network namespace, ``tc tbf``, the loopback counters.
- :mod:`bench.workload`: the model (a ``BertForMaskedLM`` from a config) and its masked-LM batches,
  from real text (default) or a synthetic language.
- :mod:`bench.measure`: one rank: every method on every link rate, timing and counting each step.
- :mod:`bench.analysis`: per-phase numbers and the issue's goals (PASS / MISS) from the raw records.
- :mod:`bench.report`: the markdown report and the PNG plots.

``recipes/`` is not a package: ``recipes/benchmark.py`` puts ``recipes/`` on ``sys.path`` and the ranks
run ``python -m bench.measure``.
"""

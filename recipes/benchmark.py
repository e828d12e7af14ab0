"""Communication benchmark: DDP fp32 / fp16 / PowerSGD against 1-bit Adam and 0/1 Adam on a small BERT.

For every link rate (one ``tc tbf`` qdisc on a network namespace's loopback, shared by all ranks), P gloo ranks on
CPU train the same BertForMaskedLM on the same text with every method. Per phase it measures the wire bytes (the
loopback's tx counter / P), the package's own byte accounting, step times, samples/s and the loss; it writes
results.json, results.md, raw.json and two PNG plots to --output_dir and prints the markdown::

    python recipes/benchmark.py   # as root, with ip and tc: 2 ranks, 40 steps, links unlimited, 1gbit, 100mbit
    python recipes/benchmark.py --no-netns --layers 2 --hidden 64 --heads 2 --intermediate 128 --vocab 512 \\
        --seq_len 32 --steps 6 --warmup_steps 2 --var_freeze_step 4 --methods ddp_fp32,zeroone  # quick, no wire
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # makes recipes/bench importable

from bench.cli import main  # noqa: E402
from bench.netns import netns_unavailable_reason  # noqa: E402, F401 - used by tests/test_benchmark.py

if __name__ == "__main__":
    try:
        sys.exit(main(description=__doc__))
    except RuntimeError as exc:
        sys.exit(f"error: {exc}")

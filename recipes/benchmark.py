"""Communication benchmark: DDP fp32 / fp16 / PowerSGD against 1-bit Adam and 0/1 Adam, on a BERT-style model.

For every link rate, ``P`` gloo ranks on CPU (one thread each) train the same small ``BertForMaskedLM`` on the
same data with every method, measuring the bytes that really crossed the link, the package's own byte
accounting, step times per phase, samples/s and the loss. It writes ``results.json``, ``results.md``,
``raw.json`` and two PNG plots to ``--output_dir`` and prints the markdown.

Run as root on Linux with ``ip`` and ``tc`` (iproute2), from the repository root::

    # default: 2 ranks, BERT 4x256 (~5.4M parameters), 40 steps on real text, links unlimited / 1gbit / 100mbit
    python recipes/benchmark.py

    # the synthetic 4-successor language of the figures measured before real text became the default
    python recipes/benchmark.py --data synthetic

    # no network namespace (not root, or to try it quickly): unthrottled host loopback, no wire bytes
    python recipes/benchmark.py --no-netns --layers 2 --hidden 64 --heads 2 --intermediate 128 \\
        --vocab 512 --seq_len 32 --steps 6 --warmup_steps 2 --var_freeze_step 4 --methods ddp_fp32,zeroone

How the link is made (DESIGN.md section 6): a private network namespace (``--netns_name``) whose loopback
carries every byte between the ranks, rate-limited with ``tc qdisc ... tbf`` (``--rates``; ``unlimited``
means no qdisc). The ranks are started once, by ``ip netns exec NS python -m torch.distributed.run
--standalone ...``, and rendezvous inside the namespace; rank 0, inside it too, switches the rate with ``tc``
between configurations while every rank waits at a barrier.

Wire bytes are the namespace loopback's transmit counter, read by rank 0 (``/proc/net/dev``: the counter
``ip -n NS -s -j link show lo`` shows) after a barrier at the start and end of every phase of every method, so
process start-up, DDP's initial parameter broadcast and process-group creation stay out of the windows. A
loopback packet is counted once on transmit (and once more on receive, which we ignore), so the transmit
counter is the sum of what all ranks sent, TCP/IP headers and ACKs included; we divide it by ``P``. One tbf
qdisc shapes all ranks' traffic together: "1gbit" is a 1 Gbit/s medium *shared* by the ranks, not a
full-duplex 1 Gbit/s port per rank. The namespace is deleted at exit (a stale one is deleted at start).

The code is the package ``recipes/bench/``: ``netns`` (the link), ``workload`` (model and data), ``measure``
(one rank), ``analysis`` (numbers and goals), ``report`` (markdown and plots), ``cli`` (this command).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # recipes/ is not a package; bench/ is

from bench.cli import main  # noqa: E402
from bench.netns import netns_unavailable_reason  # noqa: E402, F401 - used by tests/test_benchmark.py

if __name__ == "__main__":
    try:
        sys.exit(main(description=__doc__))
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)

"""The benchmark's link: a private network namespace whose loopback is rate-limited with ``tc tbf``.

The parent creates and deletes the namespace (:class:`NetNamespace`); the ranks run inside it
(``ip netns exec NS torchrun ...``), so rank 0 can set the rate and read the counters of its own
namespace directly (:func:`set_rate_here`, :func:`read_wire_counters`, :func:`qdisc_stats_here`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import Any


def parse_rate(label: str) -> float:
    """Bits per second of a tc rate label (``100mbit``, ``1gbit``, ``500kbit``); ``inf`` for ``unlimited``."""
    label = label.strip().lower()
    if label in ("unlimited", "none", "inf", "host-loopback"):
        return math.inf
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", label)
    if not m:
        raise SystemExit(f"--rates: cannot parse {label!r}; use e.g. unlimited, 1gbit, 100mbit, 500kbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def run_cmd(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    if check and res.returncode != 0:
        raise RuntimeError(f"command failed ({res.returncode}): {shlex.join(cmd)}\n{res.stderr.strip()}")
    return res


def netns_unavailable_reason() -> str | None:
    """``None`` if a rate-limited namespace can be made here, else why not."""
    if not sys.platform.startswith("linux"):
        return f"not Linux (platform {sys.platform})"
    if os.geteuid() != 0:
        return "not running as root (network namespaces and tc need root)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (apt-get install -y iproute2)"
    return None


class NetNamespace:
    """A private network namespace whose loopback is the benchmark's link; always deleted on exit."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.created = False

    def exists(self) -> bool:
        out = run_cmd(["ip", "netns", "list"]).stdout
        return any(line.split()[0] == self.name for line in out.splitlines() if line.strip())

    def create(self) -> None:
        """Delete a stale namespace of the same name, then create it and bring its loopback up."""
        if self.exists():
            print(f"note: deleting stale network namespace {self.name!r} left by an earlier run", flush=True)
            run_cmd(["ip", "netns", "del", self.name])
        run_cmd(["ip", "netns", "add", self.name])
        self.created = True
        atexit.register(self.delete)
        run_cmd(["ip", "-n", self.name, "link", "set", "lo", "up"])

    def exec_prefix(self) -> list[str]:
        """Prepend to a command to run it inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def lo_tx_bytes(self) -> int:
        """Transmit bytes of the namespace loopback as ``ip -n NS -s -j link show lo`` reports them."""
        data = json.loads(run_cmd(["ip", "-n", self.name, "-s", "-j", "link", "show", "lo"]).stdout)
        stats = data[0].get("stats64") or data[0]["stats"]
        return int(stats["tx"]["bytes"])

    def delete(self) -> None:
        if self.created:
            self.created = False
            run_cmd(["ip", "netns", "del", self.name], check=False)


# ---------------------------------------------------------------------------------- inside the namespace (rank 0)
def set_rate_here(rate: str, burst: str, latency: str) -> None:
    """Rate-limit this namespace's loopback with tbf, or remove the qdisc for ``unlimited``."""
    run_cmd(["tc", "qdisc", "del", "dev", "lo", "root"], check=False)
    if not math.isinf(parse_rate(rate)):
        run_cmd(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", burst, "latency", latency])


def qdisc_stats_here() -> dict[str, Any]:
    """tbf statistics of this namespace's loopback (bytes sent, drops, overlimits), empty without a qdisc."""
    res = run_cmd(["tc", "-s", "-j", "qdisc", "show", "dev", "lo"], check=False)
    with contextlib.suppress(ValueError, IndexError, KeyError):
        for q in json.loads(res.stdout or "[]"):
            if q.get("kind") == "tbf":
                return {k: q.get(k) for k in ("bytes", "packets", "drops", "overlimits", "requeues")}
    return {}


def read_wire_counters() -> dict[str, int]:
    """Loopback transmit counters and TCP retransmissions of this process's network namespace."""
    tx_bytes = tx_packets = 0
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                fields = rest.split()
                tx_bytes, tx_packets = int(fields[8]), int(fields[9])
    retrans = 0
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    if len(rows) >= 2 and "RetransSegs" in rows[0]:
        retrans = int(rows[1][rows[0].index("RetransSegs")])
    return {"tx_bytes": tx_bytes, "tx_packets": tx_packets, "retrans_segs": retrans}

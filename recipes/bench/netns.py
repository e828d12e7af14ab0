"""The benchmark's link: a private network namespace whose loopback is rate-limited with ``tc tbf``."""

from __future__ import annotations

import atexit
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence

import hf_zeroone.plan


def parse_rate(label: str) -> float:
    """Bits per second of a tc rate label (``100mbit``, ``1gbit``, ``500kbit``); ``inf`` for ``unlimited``."""
    label = label.strip().lower()
    if label in ("unlimited", "none", "inf", "host-loopback"):
        return math.inf
    try:
        return hf_zeroone.plan.parse_rate(label)
    except ValueError:
        raise SystemExit(f"--rates: cannot parse {label!r}; use e.g. unlimited, 1gbit, 100mbit, 500kbit") from None


def run_cmd(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run a command; if ``check``, raise ``RuntimeError`` with its stderr when it fails."""
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
    return f"{' and '.join(missing)} not found (apt-get install -y iproute2)" if missing else None


class NetNamespace:
    """A private network namespace whose loopback is the link; deleted at exit."""

    def __init__(self, name: str) -> None:
        self.name, self.created = name, False

    def create(self) -> None:
        """Delete a stale namespace of the same name, then create it and bring its loopback up."""
        listed = [line.split()[0] for line in run_cmd(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]
        if self.name in listed:
            print(f"note: deleting stale network namespace {self.name!r}", flush=True)
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
        return int((data[0].get("stats64") or data[0]["stats"])["tx"]["bytes"])

    def delete(self) -> None:
        """Delete the namespace if this object created it."""
        if self.created:
            self.created = False
            run_cmd(["ip", "netns", "del", self.name], check=False)


def set_rate_here(rate: str, burst: str, latency: str) -> None:
    """Rate-limit this process's namespace loopback with tbf, or remove the qdisc for ``unlimited``."""
    run_cmd(["tc", "qdisc", "del", "dev", "lo", "root"], check=False)
    if not math.isinf(parse_rate(rate)):
        run_cmd(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", burst, "latency", latency])


def read_wire_counters() -> dict[str, int]:
    """Transmit counters of this process's namespace loopback, from ``/proc/net/dev``."""
    with open("/proc/net/dev") as f:
        lo = next((line.partition(":")[2].split() for line in f if line.partition(":")[0].strip() == "lo"), ["0"] * 10)
    return {"tx_bytes": int(lo[8]), "tx_packets": int(lo[9])}

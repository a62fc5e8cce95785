"""The nodes' network: one network namespace per node on a bridge, links shaped with tc.

Everything is named after the cluster (``NAME-br``, ``NAME-n0``, ``NAME-v0``) so that
``remove`` finds and deletes it by name, whatever state a failed run left it in.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

from ...errors import ClusterError

__all__ = ["Link", "Node", "check_allowed", "check_free", "create", "kill_all", "node_pids",
           "remove", "set_link_state", "shape"]

NETNS_ETC = "/etc/netns"  # `ip netns exec` bind-mounts /etc/netns/NS/hosts over /etc/hosts


@dataclass(frozen=True)
class Node:
    """One node: its namespace (also its hostname), address and the bridge end of its link."""

    name: str
    address: str
    veth: str


@dataclass(frozen=True)
class Link:
    """How each node's link to the bridge is shaped: rate in bit/s, delay in s, loss in %."""

    rate: int | None = None
    delay: float = 0.0
    loss: float = 0.0

    @classmethod
    def parse(cls, text: str | None) -> Link:
        """``RATE[,DELAY[,LOSS%]]``, e.g. ``1gbit``, ``10gbit,50us``, ``1gbit,0,0.1%``."""
        if not text or text == "unshaped":
            return cls()
        parts = [p.strip() for p in text.split(",")]
        if len(parts) > 3:
            raise ClusterError(f"fastreduce.cluster: link {text!r} has more than three "
                               f"parts; give RATE[,DELAY[,LOSS%]], e.g. 1gbit,50us")
        rate = _parse_rate(parts[0]) if parts[0] else None
        delay = _parse_delay(parts[1]) if len(parts) > 1 else 0.0
        loss = _parse_loss(parts[2]) if len(parts) > 2 else 0.0
        return cls(rate, delay, loss)

    def describe(self) -> str:
        """As written on the command line: ``1gbit,50us`` or ``unshaped``."""
        if self.rate is None and not self.delay and not self.loss:
            return "unshaped"
        text = _format_rate(self.rate) if self.rate else ""
        if self.delay or self.loss:
            text += f",{self.delay * 1e6:g}us"
        if self.loss:
            text += f",{self.loss:g}%"
        return text


_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def _parse_rate(text: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]+)", text.lower())
    if not match or match.group(2) not in _RATE_UNITS:
        raise ClusterError(f"fastreduce.cluster: link rate {text!r} is not a rate; write it "
                           f"as tc does: 100mbit, 1gbit, 10gbit")
    return int(float(match.group(1)) * _RATE_UNITS[match.group(2)])


def _format_rate(rate: int) -> str:
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if rate >= _RATE_UNITS[unit] and rate % _RATE_UNITS[unit] == 0:
            return f"{rate // _RATE_UNITS[unit]}{unit}"
    return f"{rate}bit"


def _parse_delay(text: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(us|ms|s)?", text.lower())
    if not match:
        raise ClusterError(f"fastreduce.cluster: link delay {text!r} is not a time; write "
                           f"50us, 1ms or 0")
    if match.group(2) is None and float(match.group(1)) != 0:
        raise ClusterError(f"fastreduce.cluster: link delay {text!r} needs a unit: us, ms, s")
    return float(match.group(1)) * _DELAY_UNITS[match.group(2) or "s"]


def _parse_loss(text: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)%?", text)
    if not match or not 0 <= float(match.group(1)) <= 100:
        raise ClusterError(f"fastreduce.cluster: link loss {text!r} is not a percentage "
                           f"from 0 to 100, e.g. 0.1%")
    return float(match.group(1))


def _run(*cmd: str, namespace: str | None = None, check: bool = True) -> str:
    """Run ip/tc (inside `namespace` if given); ClusterError with its message if it fails."""
    full = ["ip", "netns", "exec", namespace, *cmd] if namespace else list(cmd)
    try:
        done = subprocess.run(full, capture_output=True, text=True)
    except FileNotFoundError:
        raise ClusterError(f"fastreduce.cluster: {full[0]} not found: install iproute2 "
                           f"(ip, tc) and util-linux (unshare)") from None
    if check and done.returncode != 0:
        raise ClusterError(f"fastreduce.cluster: `{' '.join(full)}` failed: "
                           f"{(done.stderr or done.stdout).strip()}")
    return done.stdout


def check_allowed() -> None:
    """Raise ClusterError saying why namespaces cannot be made here (not root, no iproute2)."""
    missing = [tool for tool in ("ip", "tc", "unshare", "hostname")
               if shutil.which(tool) is None]
    if missing:
        raise ClusterError(f"fastreduce.cluster: {', '.join(missing)} not found: install "
                           f"iproute2, util-linux and hostname")
    if os.geteuid() != 0:
        raise ClusterError("fastreduce.cluster: network namespaces need root (or "
                           "CAP_NET_ADMIN and CAP_SYS_ADMIN); run it as root")


def plan(name: str, count: int, subnet: str) -> tuple[str, str, list[Node]]:
    """(bridge name, bridge address/prefix, nodes) for `count` nodes of cluster `name`."""
    network = ipaddress.ip_network(subnet)
    hosts = list(network.hosts())
    if len(hosts) < count + 10:
        raise ClusterError(f"fastreduce.cluster: subnet {subnet} is too small for {count} "
                           f"nodes; give a /24")
    nodes = [Node(f"{name}-n{i}", str(hosts[9 + i]), f"{name}-v{i}") for i in range(count)]
    return f"{name}-br", f"{hosts[0]}/{network.prefixlen}", nodes


def check_free(name: str, subnet: str) -> None:
    """Raise ClusterError if a cluster `name` is up, or the subnet's bridge address is taken."""
    bridge, bridge_address, _ = plan(name, 1, subnet)
    if _run("ip", "-o", "link", "show", bridge, check=False):
        raise ClusterError(f"fastreduce.cluster: a cluster named {name!r} is up already "
                           f"(bridge {bridge}); `python -m fastreduce.cluster down --name "
                           f"{name}` first, or choose another --name")
    taken = _run("ip", "-o", "-4", "addr", "show")
    if f" {bridge_address.split('/')[0]}/" in taken:
        raise ClusterError(f"fastreduce.cluster: the address {bridge_address} is in use on "
                           f"this machine; choose another --subnet")


def create(name: str, count: int, subnet: str, hosts: bool = True) -> tuple[str, list[Node]]:
    """Make the bridge and the nodes; (bridge address, nodes). With `hosts`, every node
    resolves every node's name; without, a node knows only its own (as where names
    resolve only on a management network). Half-made pieces are the caller's to remove."""
    bridge, bridge_address, nodes = plan(name, count, subnet)
    _run("ip", "link", "add", bridge, "type", "bridge")
    _run("ip", "addr", "add", bridge_address, "dev", bridge)
    _run("ip", "link", "set", bridge, "up")
    prefix = bridge_address.split("/")[1]
    for node in nodes:
        _run("ip", "netns", "add", node.name)
        os.makedirs(f"{NETNS_ETC}/{node.name}", exist_ok=True)
        with open(f"{NETNS_ETC}/{node.name}/hosts", "w") as out:
            out.write("127.0.0.1 localhost\n::1 localhost\n" + "".join(
                f"{other.address} {other.name}\n" for other in nodes
                if hosts or other is node))
        _run("ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns",
             node.name)
        _run("ip", "link", "set", node.veth, "master", bridge)
        _run("ip", "link", "set", node.veth, "up")
        _run("ip", "addr", "add", f"{node.address}/{prefix}", "dev", "eth0",
             namespace=node.name)
        _run("ip", "link", "set", "eth0", "up", namespace=node.name)
        _run("ip", "link", "set", "lo", "up", namespace=node.name)
    return bridge_address.split("/")[0], nodes


def shape(nodes: list[Node], link: Link) -> None:
    """Shape both directions of every node's link (replacing any shaping before)."""
    for node in nodes:
        for device, namespace in ((node.veth, None), ("eth0", node.name)):
            _run("tc", "qdisc", "del", "dev", device, "root", namespace=namespace, check=False)
            if link.rate is None and not link.delay and not link.loss:
                continue
            qdisc = _qdisc(link)
            full = ["tc", "qdisc", "add", "dev", device, "root", *qdisc]
            if namespace:
                full = ["ip", "netns", "exec", namespace, *full]
            done = subprocess.run(full, capture_output=True, text=True)
            if done.returncode != 0 and qdisc[0] == "netem" and "unknown" in done.stderr:
                raise ClusterError(
                    "fastreduce.cluster: this kernel has no sch_netem (`tc qdisc ... netem` "
                    "is unknown), so a link delay or loss cannot be made here; give the "
                    "rate alone (e.g. --link 1gbit), which tbf shapes")
            if done.returncode != 0:
                raise ClusterError(f"fastreduce.cluster: `{' '.join(full)}` failed: "
                                   f"{done.stderr.strip()}")


def _qdisc(link: Link) -> list[str]:
    """tbf for a rate alone; netem when a delay or loss is asked (it needs sch_netem)."""
    if not link.delay and not link.loss:
        # a burst of at least rate x 1 ms, so that a fast link is not capped by the timer
        burst = max(256 * 1024, link.rate // 8 // 1000)
        return ["tbf", "rate", f"{link.rate}bit", "burst", str(burst), "latency", "50ms"]
    netem = ["netem", "limit", "100000"]
    if link.delay:
        netem += ["delay", f"{link.delay * 1e6:.0f}us"]
    if link.loss:
        netem += ["loss", f"{link.loss}%"]
    if link.rate:
        netem += ["rate", f"{link.rate}bit"]
    return netem


def set_link_state(node: Node, up: bool, settle: float = 10.0) -> None:
    """Take a node's link down (as if its cable were pulled) or bring it back; back up,
    wait (at most `settle` s) until the bridge forwards on it again."""
    _run("ip", "link", "set", node.veth, "up" if up else "down")
    deadline = time.monotonic() + settle
    while up and time.monotonic() < deadline:
        try:
            with open(f"/sys/class/net/{node.veth}/brport/state") as f:
                if f.read().strip() == "3":  # BR_STATE_FORWARDING
                    return
        except OSError:
            return
        time.sleep(0.05)


def node_pids(namespace: str) -> list[int]:
    """The processes running in a node's namespace."""
    out = _run("ip", "netns", "pids", namespace, check=False)
    return [int(pid) for pid in out.split()]


def remove(name: str) -> list[str]:
    """Kill every process in the cluster's namespaces and delete them, their links, hosts
    files and the bridge, by name; what was removed."""
    prefix = f"{name}-n"
    removed = []
    namespaces = [line.split()[0] for line in _run("ip", "netns", "list", check=False)
                  .splitlines() if line.split() and re.fullmatch(
                      re.escape(prefix) + r"\d+", line.split()[0])]
    for namespace in namespaces:
        kill_all(namespace)
        _run("ip", "netns", "del", namespace, check=False)
        removed.append(f"namespace {namespace}")
    for entry in sorted(os.listdir(NETNS_ETC)) if os.path.isdir(NETNS_ETC) else []:
        if re.fullmatch(re.escape(prefix) + r"\d+", entry):
            shutil.rmtree(f"{NETNS_ETC}/{entry}", ignore_errors=True)
    for line in _run("ip", "-o", "link", "show", check=False).splitlines():
        device = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if re.fullmatch(re.escape(name) + r"-v\d+", device):
            _run("ip", "link", "del", device, check=False)
            removed.append(f"link {device}")
    if _run("ip", "-o", "link", "show", f"{name}-br", check=False):
        _run("ip", "link", "del", f"{name}-br", check=False)
        removed.append(f"bridge {name}-br")
    return removed


def kill_all(namespace: str, grace: float = 2.0) -> None:
    """SIGTERM every process in the namespace, then SIGKILL what is left after `grace` s,
    until none is left (a process forked meanwhile gets its signal in the next round)."""
    for sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGKILL, signal.SIGKILL):
        pids = node_pids(namespace)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = node_pids(namespace)
        if not pids:
            return

"""The emulated cluster's network: one Linux network namespace per node, each
node's veth (`eth0` inside it) plugged into a bridge that lives in a namespace
of its own, and tc shaping both directions of every node's link.

Nothing is created in the caller's namespace: the bridge and every veth end
live in namespaces named `cbemu-<pid>-...` (pid = the emulate process), so
deleting those namespaces removes everything, and `cleanup()` can find the
leftovers of a run whose process died.

Shaping of node i's link (both directions behave as a NIC of the given rate):
- node -> network: `tbf` on eth0 in the node's namespace (transmit side);
- network -> node: on the bridge port `p<i>` (receive side): `netem delay`
  as the root qdisc with `tbf` as its child when a latency is given (netem's
  documented chaining; needs the kernel's sch_netem), else `tbf` alone; loss
  is a classic-BPF random-drop filter (cls_bpf, direct action) on the port's
  clsact egress, so it needs no netem.
A packet from node a to node b passes a's transmit tbf and b's receive
tbf, the delay once (one-way latency = the configured latency) and the loss
filter once (path loss = the configured percentage). Latency and loss sit on
the receive side, away from the sender's own qdisc: a local drop or delay
would be seen by the sender's TCP at once (TSQ back-pressure, immediate
retransmit), which a real network never tells it.

tbf: burst = one full-size packet, or 100 us at the rate where that is more
(above about 725 Mbit/s at MTU 9000), so the token bucket does not have to
wake more than about 10^4 times a second. A token bucket lets its burst
through at once after an idle spell, where a wire serializes every byte: a
message arriving after a pause gets its first burst free. With the earlier
burst of 1 ms at the rate (25 KB at 200 Mbit/s, more than a 16 KiB pipeline
p2p with its headers), a pipeline's p2p between compute took nearly nothing
where its back-to-back measurement took 0.66 ms; now a message after a pause
gets the burst free: 100 us at 200 Mbit/s and the default MTU 1500, 0.36 ms
(one packet) at MTU 9000.
Queue limit = 50 ms at the rate (incast of several nodes onto one queues
instead of dropping, as a lossless fabric would).
"""
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import time

PREFIX = "cbemu"
SUBNET = "10.77"            # 10.77.0.0/16, used only inside the run's own namespaces
NODE_IF = "eth0"            # the node's end of its link, inside its namespace
BRIDGE = "br0"


@dataclasses.dataclass(frozen=True)
class Shaping:
    rate_bps: int                 # bits per second
    delay_us: int = 0             # one-way, added once per path
    loss_pct: float = 0.0         # per packet, once per path


class Unsupported(ValueError):
    """This machine cannot build the emulated network (no root, no netns, a
    qdisc the kernel lacks): a one-line error, exit status 2."""


def node_addr(i: int) -> str:
    h = i + 1
    return f"{SUBNET}.{h >> 8}.{h & 255}"


def _run(cmd, unsupported=False):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        msg = (p.stderr or p.stdout).strip().splitlines()
        msg = msg[-1] if msg else f"exit status {p.returncode}"
        if unsupported:
            raise Unsupported(f"{' '.join(cmd)}: {msg}")
        raise RuntimeError(f"{' '.join(cmd)}: {msg}")
    return p.stdout


def _loss_bytecode(loss_pct: float) -> str:
    """Classic BPF for cls_bpf in direct-action mode: A = a random u32; drop
    (TC_ACT_SHOT = 2) when A < p * 2^32, else pass (TC_ACT_OK = 0)."""
    threshold = min(2 ** 32 - 1, round(loss_pct / 100 * 2 ** 32))
    ld_random = 0xFFFFF000 + 56           # SKF_AD_OFF + SKF_AD_RANDOM
    return f"4,32 0 0 {ld_random},53 0 1 {threshold},6 0 0 0,6 0 0 2"


BURST_S = 100e-6        # the token bucket's depth in time at the rate, at least one packet


def _tbf(ns: str, dev: str, rate_bps: int, mtu: int, parent: list[str]):
    rate_Bps = rate_bps / 8
    burst = max(int(rate_Bps * BURST_S), mtu + 64)
    limit = max(int(rate_Bps * 50e-3), 2 * burst)
    _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, *parent, "tbf", "rate", f"{rate_bps}bit",
          "burst", str(burst), "limit", str(limit)])


def shape(ns: str, dev: str, s: Shaping, mtu: int, receive_side: bool):
    """Shape dev's egress: rate always; on the receive side also delay and loss."""
    if receive_side and s.delay_us:
        packets = int(s.rate_bps / 8 * s.delay_us * 1e-6 / max(mtu, 1)) * 2 + 1000
        cmd = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
               "delay", f"{s.delay_us}us", "limit", str(packets)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            why = (p.stderr or p.stdout).strip()
            if "unknown" in why.lower():
                raise Unsupported("a latency needs the kernel's netem qdisc (sch_netem, CONFIG_NET_SCH_NETEM), "
                                  "which this kernel lacks; rate and loss work without it")
            raise RuntimeError(f"{' '.join(cmd)}: {why}")
        _tbf(ns, dev, s.rate_bps, mtu, ["parent", "1:1", "handle", "10:"])
    else:
        _tbf(ns, dev, s.rate_bps, mtu, ["root", "handle", "1:"])
    if receive_side and s.loss_pct:
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "clsact"], unsupported=True)
        _run(["tc", "-n", ns, "filter", "add", "dev", dev, "egress", "bpf", "da", "bytecode",
              _loss_bytecode(s.loss_pct)], unsupported=True)


class Network:
    """Create with build(); remove with destroy() (idempotent, never raises
    for what is already gone). `namespaces` lists what exists, in creation order."""

    def __init__(self, run_id: str, nodes: int, inter: Shaping, intra: Shaping | None = None, mtu: int = 1500):
        self.run_id, self.nodes, self.inter, self.intra, self.mtu = run_id, nodes, inter, intra, mtu
        self.switch = f"{run_id}-sw"
        self.node_ns = [f"{run_id}-n{i}" for i in range(nodes)]
        self.namespaces: list[str] = []

    def _add_ns(self, name: str):
        first = not self.namespaces
        self.namespaces.append(name)      # before it exists: a signal may land while `ip` creates it
        try:
            _run(["ip", "netns", "add", name], unsupported=first)
        except Unsupported:
            self.namespaces.remove(name)
            raise
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def build(self):
        if os.geteuid() != 0:
            raise Unsupported("the emulated cluster needs root (network namespaces, veth links and tc)")
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            raise Unsupported(f"the emulated cluster needs iproute2's {' and '.join(missing)}, "
                              "not found on PATH (Debian/Ubuntu: apt-get install iproute2)")
        self._add_ns(self.switch)
        sw = self.switch
        _run(["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", BRIDGE, "up"])
        for i, ns in enumerate(self.node_ns):
            self._add_ns(ns)
            port = f"p{i}"
            _run(["ip", "-n", sw, "link", "add", port, "mtu", str(self.mtu), "type", "veth",
                  "peer", "name", NODE_IF, "mtu", str(self.mtu), "netns", ns])
            _run(["ip", "-n", sw, "link", "set", port, "master", BRIDGE, "up"])
            # no IPv6 link-local address: gloo and the rendezvous use the IPv4 one
            _run(["ip", "-n", ns, "link", "set", NODE_IF, "addrgenmode", "none"])
            _run(["ip", "-n", ns, "addr", "add", f"{node_addr(i)}/16", "dev", NODE_IF])
            _run(["ip", "-n", ns, "link", "set", NODE_IF, "up"])
            shape(ns, NODE_IF, self.inter, self.mtu, receive_side=False)
            shape(sw, port, self.inter, self.mtu, receive_side=True)
            if self.intra:
                shape(ns, "lo", self.intra, 65536, receive_side=True)

    def destroy(self):
        """Stop whatever still runs inside the namespaces, then delete them
        (their veths and the bridge go with them)."""
        for ns in reversed(self.namespaces):
            kill_inside(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces = [ns for ns in self.namespaces if ns in list_namespaces()]


def list_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def kill_inside(ns: str, grace_s: float = 3.0):
    """SIGTERM, then SIGKILL, every process still inside namespace ns."""
    def pids():
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        return [int(x) for x in out.split() if x.isdigit()]
    left = pids()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + grace_s
        while left and time.monotonic() < end:
            time.sleep(0.05)
            left = pids()
        if not left:
            return


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"emulate" in f.read()
    except OSError:
        return False


def cleanup(include_live: bool = False) -> list[str]:
    """Remove the namespaces of emulate runs whose process is gone (all of
    them with include_live); returns the names removed."""
    removed = []
    for ns in list_namespaces():
        m = re.fullmatch(rf"{PREFIX}-(\d+)-(sw|n\d+)", ns)
        if m and (include_live or not alive(int(m.group(1)))):
            kill_inside(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            removed.append(ns)
    return removed

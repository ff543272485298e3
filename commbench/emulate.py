"""`commbench emulate`: an emulated multi-node cluster on one Linux machine.

Each node is a network namespace whose link into a shared bridge is shaped
with tc (commbench/netns.py says how); each rank is COMMAND started inside its
node's namespace with `ip netns exec` and the torch rendezvous environment
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR = node 0's
address, MASTER_PORT, GLOO_SOCKET_IFNAME = the node's link, COMMBENCH_HOSTNAME
= the node's name), so commbench and torch see N nodes. Exit status: the worst
rank's; everything created is removed on exit, failure, Ctrl-C and SIGTERM.
"""
import os
import re
import signal
import subprocess
import sys

from commbench import launch as launch_mod
from commbench import netns

MASTER_PORT = 29500          # the node namespaces are new: no port is taken there
_RATE_UNITS = {"bit": 1, "kbit": 10 ** 3, "mbit": 10 ** 6, "gbit": 10 ** 9, "tbit": 10 ** 12}
_TIME_UNITS = {"us": 1, "ms": 1000, "s": 1_000_000}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"


def parse_rate(text: str, flag: str = "rate") -> int:
    """'1gbit' -> 10**9 bits/s; units bit, kbit, mbit, gbit, tbit (powers of 10, as tc)."""
    m = re.fullmatch(_NUMBER + r"([a-z]+)", str(text).strip().lower())
    if not m or m.group(2) not in _RATE_UNITS:
        hint = ("; tc's bps means bytes per second: write bits, e.g. 8gbit for 1 GB/s"
                if m and m.group(2).endswith("bps") else "")
        raise ValueError(f"{flag}: bad rate {text!r}: expected a number and a unit "
                         f"(bit, kbit, mbit, gbit, tbit), e.g. 1gbit, 100mbit, 500kbit{hint}")
    bits = round(float(m.group(1)) * _RATE_UNITS[m.group(2)])
    if not 8000 <= bits <= 10 ** 12:
        raise ValueError(f"{flag}: rate {text!r} out of range: 8kbit to 1tbit")
    return bits


def parse_time(text: str, flag: str = "latency") -> int:
    """'100us' -> 100, '1ms' -> 1000, '0.5s' -> 500000 (microseconds)."""
    m = re.fullmatch(_NUMBER + r"([a-z]+)", str(text).strip().lower())
    if not m or m.group(2) not in _TIME_UNITS:
        raise ValueError(f"{flag}: bad time {text!r}: expected a number and a unit (us, ms, s), e.g. 100us, 1ms")
    us = float(m.group(1)) * _TIME_UNITS[m.group(2)]
    if us != int(us) or us > 10_000_000:
        raise ValueError(f"{flag}: time {text!r} must be whole microseconds, at most 10s")
    return int(us)


def parse_loss(text: str, flag: str = "loss") -> float:
    """'0.1%' -> 0.1 (percent); the % sign is required (0.1 alone is ambiguous)."""
    m = re.fullmatch(_NUMBER + r"%", str(text).strip())
    if not m:
        raise ValueError(f"{flag}: bad loss {text!r}: expected a percentage, e.g. 0.1%")
    pct = float(m.group(1))
    if pct >= 100:
        raise ValueError(f"{flag}: loss {text!r} must be below 100%")
    return pct


def add_args(p):
    p.add_argument("--nodes", type=int, default=None, help="emulated nodes (network namespaces)")
    p.add_argument("--ranks-per-node", type=int, default=1, help="ranks in each node (default 1)")
    p.add_argument("--inter-bw", default=None, help="each node's link rate, e.g. 1gbit, 100mbit, 500kbit")
    p.add_argument("--inter-latency", default="0us", help="one-way node-to-node latency, e.g. 100us, 1ms "
                                                          "(needs the kernel's netem qdisc)")
    p.add_argument("--loss", default="0%", help="packet loss between nodes, e.g. 0.1%%")
    p.add_argument("--intra-bw", default=None, help="shape traffic inside a node too (its loopback) at this rate "
                                                   "(default: unshaped, memory speed)")
    p.add_argument("--intra-latency", default="0us", help="with --intra-bw: latency inside a node")
    p.add_argument("--mtu", type=int, default=1500,
                   help="MTU of the node links (default 1500: TCP/IP headers take about 4.4%% of the rate; 9000, "
                        "jumbo frames: about 1%%). A message after a pause passes the token bucket's burst, one "
                        "packet or 100 us at the rate, at once")
    p.add_argument("--cleanup", action="store_true",
                   help="remove the namespaces left by emulate runs whose process is gone, and exit")
    p.add_argument("command", nargs="...", help="-- COMMAND...: what each rank runs")


def _command(argv: list[str]) -> list[str]:
    """COMMAND with `commbench` resolved to this installation's (ranks run
    under `ip netns exec`, whose PATH may not have it)."""
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise ValueError("emulate: give the command each rank runs after --, e.g. "
                         "-- commbench run --collective all_reduce --groups world,intra,inter")
    if argv[0] == "commbench":
        return [sys.executable, "-m", "commbench", *argv[1:]]
    return list(argv)


def describe(inter: netns.Shaping, intra: netns.Shaping | None, mtu: int) -> str:
    """The emulated network in one line, recorded in every rank's environment
    (COMMBENCH_EMULATED, allow-listed: it lands in the results header)."""
    text = (f"inter_bw={inter.rate_bps}bit inter_latency={inter.delay_us}us loss={inter.loss_pct:g}% mtu={mtu}")
    if intra:
        text += f" intra_bw={intra.rate_bps}bit intra_latency={intra.delay_us}us"
    return text


def _rank_env(rank: int, node: int, local: int, nodes: int, per_node: int) -> dict:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_", "GROUP_RANK", "MASTER_", "TORCHELASTIC", "PMI_", "PMIX_", "OMPI_",
            "MV2_", "PALS_", "SLURM_", "MPI_LOCAL")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(RANK=str(rank), WORLD_SIZE=str(nodes * per_node), LOCAL_RANK=str(local),
               LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(node), MASTER_ADDR=netns.node_addr(0),
               MASTER_PORT=str(MASTER_PORT), GLOO_SOCKET_IFNAME=netns.NODE_IF,
               COMMBENCH_HOSTNAME=f"node{node}", COMMBENCH_LAUNCHER="emulate")
    # every emulated node shares this machine's cores
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (nodes * per_node))))
    return env


class _Signalled(BaseException):
    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def _raise(signum, _frame):
    raise _Signalled(signum)


def run(nodes: int, per_node: int, inter: netns.Shaping, intra: netns.Shaping | None, mtu: int,
        command: list[str]) -> int:
    """Build the network, run COMMAND as nodes x per_node ranks, remove the network."""
    if not 1 <= nodes <= 4000:
        raise ValueError(f"--nodes must be between 1 and 4000, got {nodes}")
    if per_node < 1:
        raise ValueError(f"--ranks-per-node must be at least 1, got {per_node}")
    if not 576 <= mtu <= 65535:
        raise ValueError(f"--mtu must be between 576 and 65535, got {mtu}")
    net = netns.Network(f"{netns.PREFIX}-{os.getpid()}", nodes, inter, intra, mtu)
    procs = []
    old = {s: signal.signal(s, _raise) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        net.build()
        for node, ns in enumerate(net.node_ns):
            for local in range(per_node):
                env = _rank_env(node * per_node + local, node, local, nodes, per_node)
                env["COMMBENCH_EMULATED"] = describe(inter, intra, mtu)
                # `ip netns exec` execs COMMAND in place: the pid is the rank's
                procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *command], env=env,
                                              start_new_session=True))
        return launch_mod._wait_all(procs)
    except _Signalled as e:
        return 128 + e.signum
    finally:
        for s in old:                 # a second Ctrl-C must not cut the cleanup short
            signal.signal(s, signal.SIG_IGN)
        try:
            launch_mod._stop(procs, grace_s=5.0)
            net.destroy()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        if net.namespaces:
            print(f"commbench emulate: could not remove {', '.join(net.namespaces)}; "
                  "run commbench emulate --cleanup", file=sys.stderr)


def cli(a) -> int:
    if a.cleanup:
        if os.geteuid() != 0:
            raise netns.Unsupported("emulate --cleanup needs root")
        removed = netns.cleanup()
        print(f"removed {len(removed)} namespace(s) of dead emulate runs" + (f": {' '.join(removed)}" if removed else ""))
        return 0
    if a.nodes is None or a.inter_bw is None:
        raise ValueError("emulate needs --nodes and --inter-bw (and -- COMMAND)")
    inter = netns.Shaping(parse_rate(a.inter_bw, "--inter-bw"), parse_time(a.inter_latency, "--inter-latency"),
                          parse_loss(a.loss, "--loss"))
    intra = None
    if a.intra_bw is not None:
        intra = netns.Shaping(parse_rate(a.intra_bw, "--intra-bw"), parse_time(a.intra_latency, "--intra-latency"))
    elif a.intra_latency != "0us":
        raise ValueError("--intra-latency needs --intra-bw")
    return run(a.nodes, a.ranks_per_node, inter, intra, a.mtu, _command(a.command))

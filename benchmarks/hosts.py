"""A testbed of real hosts on this machine: network namespaces, one rate-limited link each,
and a Ray node in each (docs/hosts.md).

    with Testbed(hosts=2, slots=2, rate_mbit=200) as bed:   # as root; Testbed.unavailable() says why not
        sent = bed.sent()                                    # bytes each host sent over its link so far
        result = bed.run([sys.executable, "-m", "tests.scripts.hosts", ...])   # a driver on host 0
        bed.cut(1); bed.heal(1)                              # partition host 1, then join it again
        bed.kill(1); bed.replace_node(1)                     # lose host 1's Ray node, then a new one once Ray counts it dead
    # every process started in the namespaces ended by its id, the namespaces, links and bridge deleted

Each host is a network namespace with one interface (``eth0``), a veth pair whose other end
sits on a bridge in the root namespace. The bridge has no address: the hosts reach each
other and nothing else, on a private /24 that exists only inside these namespaces. Both ends
of a host's link are shaped by a token bucket (``tc qdisc ... tbf rate R``), so what a host
sends and receives crosses at most ``R``; ranks on one host talk over the namespace's own
loopback, unshaped and uncounted, like the inside of a node. The bytes a host sent are the
bridge-side end's received bytes (``/sys/class/net/<end>/statistics/rx_bytes``): the traffic
on the wire, counted by the kernel, not by the program.

Each host runs a Ray node (``ray start --block``, the head on host 0) with ``slots`` CPUs and
``GLOO_SOCKET_IFNAME=eth0`` in its environment, which every worker it starts inherits, so
gloo binds to the host's link. The cluster uses Ray's token authentication with a token of
the testbed's own (``RAY_AUTH_TOKEN``), passed to every process started here. A command run
with ``run``/``popen`` runs inside a host's namespace (host 0 by default: where the head and
the driver sit, as on a real cluster's head node) with ``RAY_ADDRESS`` set to the head.

Ending: the processes in a namespace are listed by the kernel (``ip netns pids``) and each
is killed by its id; then the namespaces, the bridge-side ends of the links (a namespace
whose process lingers keeps its pair) and the bridge are deleted, and the Ray temp dirs
removed. ``close`` does it whatever state the testbed reached, and runs at exit too.
"""

from __future__ import annotations

import atexit
import bisect
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

SUBNET = "10.213.57"
"""The testbed's /24: no interface outside its namespaces has an address in it."""
HEAD_PORT = 6379


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _tc(namespace: str | None, *args: str) -> None:
    cmd = ["tc", *args] if namespace is None else ["ip", "netns", "exec", namespace, "tc", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class Testbed:
    """``hosts`` namespaces of ``slots`` Ray CPU slots each, joined by links of ``rate_mbit``."""

    __test__ = False  # not a test class, for pytest

    def __init__(self, hosts: int, slots: int, rate_mbit: float, *, name: str | None = None) -> None:
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts must be 1..200, got {hosts}")
        if slots < 1 or rate_mbit <= 0:
            raise ValueError(f"slots must be >= 1 and rate_mbit > 0, got {slots} and {rate_mbit}")
        self.hosts, self.slots, self.rate_mbit = hosts, slots, rate_mbit
        self.name = name or f"edp{os.getpid() % 100000}"  # interface names: 15 characters at most
        self.bridge = f"{self.name}br"
        self.token = secrets.token_hex(32)
        self.root = Path(tempfile.mkdtemp(prefix=f"{self.name}-", dir="/tmp"))
        self._made: list[tuple[str, str]] = []  # ("netns"|"link", name), in the order made
        self.node_ids: dict[int, str] = {}
        """Each host's Ray node, the one started last there: the control store may still count
        an earlier one of that address alive for a while."""
        self._closed = False
        atexit.register(self.close)

    # -- names ---------------------------------------------------------------------------------
    def namespace(self, host: int) -> str:
        return f"{self.name}h{host}"

    def end(self, host: int) -> str:
        """The bridge-side end of ``host``'s link (in the root namespace)."""
        return f"{self.name}v{host}"

    def address_of(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    @property
    def address(self) -> str:
        """The Ray head's address (``ray.init(address=...)``, ``--address``)."""
        return f"{self.address_of(0)}:{HEAD_PORT}"

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to join this testbed's Ray cluster."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, "RAY_ADDRESS": self.address,
                "GLOO_SOCKET_IFNAME": "eth0", "RAY_USAGE_STATS_ENABLED": "0"}

    # -- lifecycle -----------------------------------------------------------------------------
    @staticmethod
    def unavailable() -> str | None:
        """Why this machine cannot make a testbed (None: it can)."""
        if not sys.platform.startswith("linux"):
            return "network namespaces need Linux"
        if os.geteuid() != 0:
            return "making network namespaces and links needs root"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return f"the {tool} command (iproute2) is not installed"
        probe = f"edpprobe{os.getpid() % 100000}"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"ip netns add failed: {made.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return None

    def __enter__(self) -> Testbed:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Make the hosts and their links, then start a Ray node on each (head first) and wait
        until the cluster has them all."""
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _ip("link", "set", self.bridge, "up")
        for h in range(self.hosts):
            ns, end = self.namespace(h), self.end(h)
            _ip("netns", "add", ns)
            self._made.append(("netns", ns))
            _ip("link", "add", end, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._made.append(("link", end))
            _ip("link", "set", end, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.address_of(h)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            shape = ["qdisc", "add", "dev", None, "root", "tbf", "rate", f"{self.rate_mbit}mbit",
                     "burst", "64kb", "latency", "100ms"]
            _tc(None, *[end if a is None else a for a in shape])      # what the host receives
            _tc(ns, *["eth0" if a is None else a for a in shape])    # what the host sends
        for h in range(self.hosts):
            self.start_node(h, wait=False)
        live = self.wait_nodes(lambda live: live if len(set(live.values())) == self.hosts else None,
                               f"{self.hosts} Ray nodes")
        self.node_ids = {h: next(n for n, a in live.items() if a == self.address_of(h)) for h in range(self.hosts)}

    def start_node(self, host: int, *, wait: bool = True) -> None:
        """Start a Ray node in ``host``'s namespace (the head on host 0), ``slots`` CPUs; with
        ``wait``, until the cluster counts one more live node."""
        before = self.live_nodes() if wait else {}
        temp = self.root / f"h{host}-{time.monotonic_ns()}"
        temp.mkdir()
        join = (["--head", f"--port={HEAD_PORT}", "--include-dashboard=false"] if host == 0
                else [f"--address={self.address}"])
        argv = [str(Path(sys.executable).parent / "ray"), "start", "--block", *join,
                f"--node-ip-address={self.address_of(host)}", f"--num-cpus={self.slots}",
                f"--temp-dir={temp}", "--object-store-memory=200000000"]
        log = open(temp / "ray-start.log", "w")
        self.popen(argv, host=host, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        if host == 0:
            self._wait_head()
        if wait:
            new = self.wait_nodes(lambda live: [n for n, a in live.items() if n not in before and a == self.address_of(host)],
                                  f"a new Ray node on host {host}")
            self.node_ids[host] = new[0]

    def _wait_head(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            probe = subprocess.run(["ip", "netns", "exec", self.namespace(0), sys.executable, "-c",
                                    f"import socket; socket.create_connection(('{self.address_of(0)}', {HEAD_PORT}), 1)"],
                                   capture_output=True)
            if probe.returncode == 0:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the testbed's Ray head did not listen within {timeout_s:.0f} s (logs in {self.root})")

    def live_nodes(self) -> dict[str, str]:
        """The live nodes the cluster's control store counts: node id -> address."""
        code = ("import json, ray; ray.init(log_to_driver=False, logging_level='ERROR'); "
                "print('nodes:' + json.dumps({n['NodeID']: n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']}))")
        done = self.run([sys.executable, "-c", code], timeout_s=60)
        listed = [line for line in done.stdout.splitlines() if line.startswith("nodes:")]
        if done.returncode != 0 or not listed:
            raise RuntimeError(f"could not list the testbed's nodes: {done.stdout[-1000:]} {done.stderr[-2000:]}")
        return json.loads(listed[-1].removeprefix("nodes:"))

    def wait_nodes(self, ready: Callable[[dict[str, str]], Any], what: str, timeout_s: float = 90.0) -> Any:
        """Until ``ready(live_nodes())`` is true; what it returned."""
        deadline = time.monotonic() + timeout_s
        while not (answer := ready(live := self.live_nodes())):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} after {timeout_s:.0f} s: live {sorted(live.values())} "
                                   f"(logs in {self.root})")
            time.sleep(0.5)
        return answer

    def close(self) -> None:
        """End every process started in the namespaces (by id), delete the namespaces, links
        and bridge, and remove the temp dirs; safe to call twice and from a failed start."""
        if self._closed:
            return
        self._closed = True
        for kind, name in self._made:
            if kind == "netns":
                self._kill(name)
        for kind, name in reversed(self._made):
            if kind == "netns":
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)
        self._made = []
        shutil.rmtree(self.root, ignore_errors=True)
        atexit.unregister(self.close)

    def _kill(self, namespace: str, timeout_s: float = 10.0) -> list[int]:
        """SIGKILL every process in ``namespace`` by its id until none is left; their ids."""
        killed: list[int] = []
        deadline = time.monotonic() + timeout_s
        while pids := self.pids(namespace):
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {pids} in {namespace} outlived SIGKILL for {timeout_s:.0f} s")
            time.sleep(0.05)
        return killed

    @staticmethod
    def pids(namespace: str) -> list[int]:
        listed = _ip("netns", "pids", namespace, check=False)
        return [int(p) for p in listed.stdout.split()] if listed.returncode == 0 else []

    # -- running -------------------------------------------------------------------------------
    def popen(self, argv: Sequence[str], *, host: int = 0, env: dict[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """Start ``argv`` in ``host``'s namespace, with the testbed's environment (and ``env``)."""
        full = {**os.environ, **self.env, **(env or {})}
        return subprocess.Popen(["ip", "netns", "exec", self.namespace(host), *argv], env=full, **kwargs)

    def run(self, argv: Sequence[str], *, host: int = 0, env: dict[str, str] | None = None,
            timeout_s: float = 600.0, cwd: str | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` in ``host``'s namespace to its end; on timeout it is killed by id."""
        proc = self.popen(argv, host=host, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=cwd)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += f"\n[testbed] killed after {timeout_s:.0f} s"
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    # -- the links -----------------------------------------------------------------------------
    def sent(self) -> list[int]:
        """The bytes each host has sent over its link so far (the kernel's count)."""
        return [int(Path(f"/sys/class/net/{self.end(h)}/statistics/rx_bytes").read_text())
                for h in range(self.hosts)]

    def cut(self, host: int) -> None:
        """Partition ``host``: its link goes down (its processes live on, unreachable)."""
        _ip("link", "set", self.end(host), "down")

    def heal(self, host: int) -> None:
        _ip("link", "set", self.end(host), "up")

    def kill(self, host: int) -> list[int]:
        """Lose ``host``: every process in its namespace (its Ray node, its workers) killed
        by id; the ids killed. Its namespace and link stay, for ``start_node``."""
        return self._kill(self.namespace(host))

    def replace_node(self, host: int, grace_s: float = 10.0) -> None:
        """A new Ray node on ``host`` once the control store counts its last one dead. What
        still runs there is sent SIGTERM by id first (a raylet so ended tells the control store
        it leaves), then SIGKILL after ``grace_s``. A node killed outright is counted alive until
        Ray's health checks fail (16-17 s here): a new node started before that sat beside a
        stale one of the same address, on which the next run's workers could be placed and
        wait for that verdict."""
        ns, old = self.namespace(host), self.node_ids.get(host)
        for pid in self.pids(ns):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while self.pids(ns) and time.monotonic() < deadline:
            time.sleep(0.1)
        self._kill(ns)
        if old is not None:
            self.wait_nodes(lambda live: old not in live, f"end of host {host}'s node {old[:8]} in the control store")
        self.start_node(host)


class LinkLog:
    """The bytes each host of ``bed`` has sent, sampled every ``interval_s`` on a thread of its
    own while the ``with`` lasts; ``at(t)`` reads them at wall-clock time ``t`` (interpolated),
    so that bytes are taken between two moments a run recorded (two steps' commit times)
    rather than between two moments the reader happened to look."""

    def __init__(self, bed: Testbed, interval_s: float = 0.02) -> None:
        self.bed, self.interval_s = bed, interval_s
        self.samples: list[tuple[float, list[int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="link-log", daemon=True)

    def __enter__(self) -> LinkLog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self.bed.sent()))
            self._stop.wait(self.interval_s)

    def at(self, t: float) -> list[float]:
        """Each host's bytes sent by time ``t``."""
        times = [s[0] for s in self.samples]
        i = bisect.bisect_left(times, t)
        if i == 0 or i == len(times):
            raise ValueError(f"{t} is outside the {len(times)} samples taken ({times[:1]}..{times[-1:]})")
        (t0, b0), (t1, b1) = self.samples[i - 1], self.samples[i]
        w = (t - t0) / (t1 - t0) if t1 > t0 else 1.0
        return [a + w * (b - a) for a, b in zip(b0, b1)]

    def per_step(self, steps: list[dict], first: int, last: int) -> list[float]:
        """Each host's bytes per step between the commits of steps ``first`` and ``last``
        (``steps``: records with ``step`` and its wall-clock ``time``, as metrics.jsonl's)."""
        at = {m["step"]: m["time"] for m in steps}
        return [(b - a) / (last - first) for a, b in zip(self.at(at[first]), self.at(at[last]))]

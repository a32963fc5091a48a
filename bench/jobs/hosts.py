"""Emulated hosts: one Linux network namespace per host on a bridge, each link shaped both ways.

``collective bench --hosts H [--link RATE]`` and the multi-host tests run a job's processes as if
on H machines, on this one::

    with EmulatedHosts(2, link="1gbit") as hosts:
        argv = hosts.command(0, [sys.executable, "-m", "module"])  # runs inside host 0
        hosts.address(0)  # host 0's address, reachable from every host

Each host is a namespace ``col<run>h<i>`` with its loopback and one veth, ``eth0``, whose other end
joins the run's bridge ``col<run>br``; with ``link`` both ends of the veth get a ``tbf`` queue at
that rate (traffic out of the host and into it). Names and the subnet carry a run number, so runs
at once do not collide, and a run's namespaces are removed on every exit path of the ``with``
(also Ctrl-C and SIGTERM, which unwind as exceptions in the bench's commands; a run killed outright
leaves them to the next run, which removes what runs whose process is gone left behind). Addresses
live only inside the namespaces made here; nothing is sent anywhere else.

It needs root and ``ip``/``tc`` (iproute2): ``unavailable()`` says why not, in one sentence.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from types import TracebackType

__all__ = ["INTERFACE", "EmulatedHosts", "HostsError", "link_bytes_per_second", "unavailable"]

INTERFACE = "eth0"  # every host's link, by the same name (GLOO_SOCKET_IFNAME)
_PREFIX = "col"  # namespaces and links of this module: col<run>h<i>, col<run>br, col<run>v<i>
_RATE = re.compile(r"^(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)$", re.IGNORECASE)
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


class HostsError(RuntimeError):
    """The emulated hosts could not be set up (an ``ip`` or ``tc`` command failed)."""


def link_bytes_per_second(rate: str) -> float:
    """``1gbit`` -> 125e6: a tc rate (bit, kbit, mbit, gbit, tbit per second) in bytes per second.

    Raises ValueError naming the accepted forms.
    """
    match = _RATE.match(rate.strip())
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"link rate {rate!r}: use a number and a unit, e.g. 100mbit, 1gbit, 10gbit")
    return float(match.group(1)) * _UNITS[match.group(2).lower()] / 8


def unavailable() -> str | None:
    """Why hosts cannot be emulated here (None when they can): root and iproute2 are needed."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces): run as root, or without --hosts"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"emulated hosts need {' and '.join(missing)} (iproute2): install it, or run without --hosts"
    return _refused()


@functools.cache
def _refused() -> str | None:
    """Why this machine refuses a network namespace or a veth pair (a container without the
    capability, say), found by making one of each and removing them; None when it does not."""
    probe = f"{_PREFIX}pb{os.getpid()}"  # (at most 15 characters with its veth peer's "p")
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
        _ip("link", "add", probe, "type", "veth", "peer", "name", f"{probe}p")
        _ip("link", "del", probe)
    except HostsError as exc:
        _ip("netns", "del", probe, check=False)
        return f"emulated hosts cannot be made here ({exc}): run without --hosts"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise HostsError(f"'ip {' '.join(args)}' failed: {done.stderr.strip()}")
    return done


def _tc(*args: str) -> None:
    done = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise HostsError(f"'tc {' '.join(args)}' failed: {done.stderr.strip()}")


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EmulatedHosts:
    """``count`` emulated hosts for the length of a ``with`` block (see the module's doc)."""

    def __init__(self, count: int, link: str | None = None) -> None:
        if count < 1:
            raise ValueError(f"hosts must be >= 1, got {count}")
        if link is not None:
            link_bytes_per_second(link)  # (a bad rate is refused before anything is made)
        self.count = count
        self.link = link
        self.run = -1  # chosen when the hosts are made (another run may be made meanwhile)
        self._made: list[tuple[str, ...]] = []  # undo commands, in the order of making

    # -- names -----------------------------------------------------------------------------------

    @staticmethod
    def _free_run() -> int:
        """A run number (0..9999) no other live run uses: the owner's pid is in a marker file."""
        _remove_orphans()
        taken = {int(m.group(1)) for ns in _namespaces() if (m := re.match(rf"^{_PREFIX}(\d+)h", ns))}
        if os.path.isdir(_MARKERS):
            taken |= {int(name) for name in os.listdir(_MARKERS) if name.isdecimal()}
        start = os.getpid() % 10000
        return next((start + i) % 10000 for i in range(10000) if (start + i) % 10000 not in taken)

    def namespace(self, host: int) -> str:
        return f"{_PREFIX}{self.run}h{host}"

    def _veth(self, host: int) -> str:
        """The outer end of host ``host``'s link (its inner end is the host's ``eth0``)."""
        return f"{_PREFIX}{self.run}v{host}"

    @property
    def bridge(self) -> str:
        return f"{_PREFIX}{self.run}br"

    def address(self, host: int) -> str:
        """Host ``host``'s address on the run's subnet (10.<a>.<b>.<host + 1>/24)."""
        return f"10.{100 + self.run // 100}.{self.run % 100}.{host + 1}"

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``host`` (``ip netns exec`` execs it: the pid is the program's)."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    # -- making and removing ---------------------------------------------------------------------

    def __enter__(self) -> EmulatedHosts:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def _make(self) -> None:
        self.run = self._free_run()
        _marker_write(self.run)
        self._made.append(("marker",))
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", "del", self.bridge))
        _ip("link", "set", self.bridge, "up")
        for host in range(self.count):
            ns, outside = self.namespace(host), self._veth(host)
            _ip("netns", "add", ns)
            self._made.append(("netns", "del", ns))
            _ip("link", "add", outside, "type", "veth", "peer", "name", f"{outside}p")
            self._made.append(("link", "del", outside))
            _ip("link", "set", f"{outside}p", "netns", ns)
            _ip("-n", ns, "link", "set", f"{outside}p", "name", INTERFACE)
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", INTERFACE)
            _ip("-n", ns, "link", "set", INTERFACE, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            if self.link is not None:
                self._shape(host, self.link)

    def _shape(self, host: int, rate: str, verb: str = "add") -> None:
        """A token bucket at ``rate`` on both ends of host ``host``'s link: into the host and out
        of it. The bucket holds 4 ms of the rate (at least 64 KiB, a GSO segment), so the kernel's
        timer granularity does not cap the rate; the queue holds 20 ms."""
        burst = max(64 * 1024, int(link_bytes_per_second(rate) * 0.004))
        shape = ("root", "tbf", "rate", rate, "burst", str(burst), "latency", "20ms")
        _tc("qdisc", verb, "dev", self._veth(host), *shape)
        _ip("netns", "exec", self.namespace(host), "tc", "qdisc", verb, "dev", INTERFACE, *shape)

    def close(self) -> None:
        """Remove what was made, newest first (each step whatever the others did)."""
        while self._made:
            undo = self._made.pop()
            if undo == ("marker",):
                _marker_remove(self.run)
            else:
                _ip(*undo, check=False)

    def set_link(self, host: int, up: bool) -> None:
        """Take host ``host``'s link down (a pulled cable, a failed switch port) or up again."""
        _ip("link", "set", self._veth(host), "up" if up else "down")

    def reshape(self, host: int, rate: str) -> None:
        """Set host ``host``'s link rate, both ways, to ``rate`` (e.g. ``10mbit``) from now on."""
        self._shape(host, rate, "replace")


# -- runs whose process is gone ------------------------------------------------------------------

_MARKERS = "/run/collective-hosts"  # run number -> the pid of the process that made it


def _marker_write(run: int) -> None:
    os.makedirs(_MARKERS, exist_ok=True)
    with open(os.path.join(_MARKERS, str(run)), "w", encoding="ascii") as handle:
        handle.write(str(os.getpid()))


def _marker_remove(run: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(_MARKERS, str(run)))


def _remove_orphans() -> None:
    """Remove the namespaces and links of runs whose process is gone (killed outright, say)."""
    if not os.path.isdir(_MARKERS):
        return
    for name in os.listdir(_MARKERS):
        path = os.path.join(_MARKERS, name)
        try:
            with open(path, encoding="ascii") as handle:
                owner = int(handle.read().strip() or 0)
        except (OSError, ValueError):
            continue
        if not name.isdecimal() or (owner and _alive(owner)):
            continue
        run = int(name)
        for ns in _namespaces():
            if re.match(rf"^{_PREFIX}{run}h\d+$", ns):
                _ip("netns", "del", ns, check=False)
        links = _ip("-o", "link", "show", check=False).stdout
        for match in re.finditer(rf"^\d+: ({_PREFIX}{run}(?:br|v\d+))[@:]", links, re.MULTILINE):
            _ip("link", "del", match.group(1), check=False)
        _marker_remove(run)

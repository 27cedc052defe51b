"""CPU accounting from /proc: the postmaster and all its children versus this process, and how
long runnable work waited for a core."""

from __future__ import annotations

import os
import threading
import time

_CLK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, utime + stime ticks) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].split()
    return int(fields[1]), int(fields[11]) + int(fields[12])


def process_cpu_s(pid: int) -> float:
    """Seconds of CPU (user + system) process ``pid`` has spent; 0.0 if it is gone."""
    st = _stat(pid)
    return st[1] / _CLK if st is not None else 0.0


def _cpu_pressure_us() -> int:
    """Microseconds during which at least one runnable task waited for a core (the kernel's
    pressure stall information, /proc/pressure/cpu "some"); 0 where the kernel does not say."""
    try:
        with open("/proc/pressure/cpu") as f:
            return int(f.readline().rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        return 0


def _thread_run_delay_ns() -> int:
    """Nanoseconds the calling thread has waited for a core while runnable; 0 if unknown."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _machine() -> tuple[int, int]:
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:9]]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, idle


class CpuMeter:
    """Average cores kept busy by Postgres, by this process, and by the whole machine; the share
    of the time some runnable task waited for a core (``cpu_pressure``), and the share the thread
    that entered the meter (the event loop) waited for one (``loop_wait``): where both are high,
    the machine's cores, not the code's own waits, bound the run.

    Postgres backends come and go, so the tree is sampled every ``interval`` and the largest
    per-pid tick count seen is kept (a backend's ticks only grow)."""

    def __init__(
        self, postmaster_pid: int | None, interval: float = 0.1, *, receiver: int | None = None
    ) -> None:
        self.pm = postmaster_pid
        #: A webhook receiver's process (one process, no children), metered as ``receiver_cores``.
        self.receiver = receiver
        self.interval = interval
        self._seen: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _pg_ticks(self) -> int:
        """Ticks of the postmaster and its children (every backend is a direct child)."""
        if self.pm is None:
            return 0
        for name in os.listdir("/proc"):
            if name.isdigit():
                pid = int(name)
                st = _stat(pid)
                if st is not None and (pid == self.pm or st[0] == self.pm):
                    self._seen[pid] = max(self._seen.get(pid, 0), st[1])
        return sum(self._seen.values())

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._pg_ticks()

    def __enter__(self) -> CpuMeter:
        self._pg0 = self._pg_ticks()
        self._seen_start = dict(self._seen)
        self._me0 = sum(os.times()[:2])
        self._rx0 = self._receiver_ticks()
        self._m0 = _machine()
        self._cp0 = _cpu_pressure_us()
        self._lw0 = _thread_run_delay_ns()
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def _receiver_ticks(self) -> int:
        st = _stat(self.receiver) if self.receiver is not None else None
        return st[1] if st is not None else 0

    def __exit__(self, *exc: object) -> None:
        rx = self._receiver_ticks() - self._rx0
        pressure, loop_wait = _cpu_pressure_us() - self._cp0, _thread_run_delay_ns() - self._lw0
        self._stop.set()
        self._thread.join()
        pg1 = self._pg_ticks()
        elapsed = time.perf_counter() - self._t0
        started = sum(self._seen_start.get(p, 0) for p in self._seen)
        pg = (pg1 - started) / _CLK
        me = sum(os.times()[:2]) - self._me0
        busy1, _ = _machine()
        busy = (busy1 - self._m0[0]) / _CLK
        self.elapsed = elapsed
        self.pg_cores = pg / elapsed if elapsed else 0.0
        self.py_cores = me / elapsed if elapsed else 0.0
        self.sys_cores = busy / elapsed if elapsed else 0.0
        self.receiver_cores = rx / _CLK / elapsed if elapsed else 0.0
        self.cpu_pressure = pressure / 1e6 / elapsed if elapsed else 0.0
        self.loop_wait = loop_wait / 1e9 / elapsed if elapsed else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "pg_cores": round(self.pg_cores, 3),
            "py_cores": round(self.py_cores, 3),
            "sys_cores": round(self.sys_cores, 3),
            "cpu_pressure": round(self.cpu_pressure, 3),
            "loop_wait": round(self.loop_wait, 3),
            **({"receiver_cores": round(self.receiver_cores, 3)} if self.receiver else {}),
        }


def rss_kb(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in KiB."""
    rss = hwm = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    return rss, hwm

"""What the benchmarks share: running one configuration in its own process
(so its peak RSS is its own, with OpenBLAS preloaded as the CLI does), and
two configurations in lockstep (run_lockstep: each in its own process, taking
turns step by step, so that the machine's drift falls on both alike), and
the direct-read rate of files: the device's best at the pager's own I/O
shape (read_rate, the rate an honest bound divides by), and one `dd` stream
for comparison (dd_rate)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def cpu_steal_s():
    """Seconds of CPU time the hypervisor gave to others while this machine's
    CPUs had work to run ("steal" in /proc/stat), summed over its CPUs,
    since boot; None where there is no /proc/stat (macOS) or no such field.
    A step's difference is what the host took from its compute: on a 2-vCPU
    cloud VM, reading while both vCPUs compute costs about 0.45 s of steal a
    GB, while reading alone costs none (the host serves the virtual disk on
    the same cores), and a Mac has none."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")


def run_worker(script: str, cfg: dict, cap: int = None) -> dict:
    """Runs `script --worker CFG` and returns the JSON after its RESULT line.
    `cap`: under a hard memory cgroup of that many bytes (the tests' own
    tests/python/cgroup.py), adding "cgroup_peak" (bytes charged at most)
    and "cap"; where no cgroup can be made, uncapped with "cap_unavailable"
    saying why. cfg["env"], if any: environment variables the worker starts
    with (set before anything loads, as OPENBLAS_THREAD_TIMEOUT must be)."""
    env = _worker_env(cfg.get("env"))
    cmd = [sys.executable, str(Path(script).resolve()), "--worker", json.dumps(cfg)]
    extra = {}
    if cap:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "python"))
        from cgroup import run_capped, unavailable_reason

        why = unavailable_reason()
        if why is None:
            out, peak = run_capped(cmd, cap, timeout=3600, env=env)
            extra = {"cap": cap, "cgroup_peak": peak}
        else:
            extra = {"cap_unavailable": why}
    if not extra.get("cap"):
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    return _result(cfg.get("name", cfg), out.stdout, out.stderr, out.returncode, extra)


def _worker_env(extra: dict = None) -> dict:
    from mlx_pager.blas import openblas_path

    env = dict(os.environ, **(extra or {}))
    lib = openblas_path()
    if lib and lib not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = lib
    return env


def _result(name, out: str, err: str, code: int, extra: dict) -> dict:
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]), **extra)
    raise RuntimeError(
        f"worker {name} failed (exit {code}{', capped' if extra.get('cap') else ''}):\n{out[-3000:]}\n{err[-3000:]}"
    )


class Lockstep:
    """A worker's side of run_lockstep: one turn token passed between two
    processes over a socket. Each step (and what the worker does untimed
    around it: validation, planning) runs while its process holds the token,
    so the two never run at once and each step runs right after the other's.
    A partner that has exited (EOF) no longer holds anything back.

    Protocol, one byte per message: the second process, once ready, sends
    one; the first waits for it (so that neither's step overlaps the other's
    start-up), then both send the token on release and wait for it on
    acquire."""

    def __init__(self, fd: int, first: bool):
        self.sock = socket.socket(fileno=fd)
        self.first, self.held, self.started, self.alone = first, False, False, False

    @staticmethod
    def from_cfg(cfg: dict):
        ls = cfg.get("lockstep")
        return Lockstep(ls["fd"], ls["first"]) if ls else None

    def acquire(self) -> None:
        """Waits for the token (a no-op while held or once the partner is gone)."""
        if self.held or self.alone:
            return
        if not self.started:
            self.started = True
            if not self.first:
                self._send()  # ready: the first process may start its step
        if not self.alone:
            try:
                self.alone = self.sock.recv(1) == b""
            except OSError:
                self.alone = True
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._send()

    def turn(self) -> None:
        """After a step: the partner's turn, then this process's again (after
        the last step, that waits for the partner's last step to end, so that
        this process's exit does not overlap it)."""
        self.release()
        self.acquire()

    def _send(self) -> None:
        if self.alone:
            return
        try:
            self.sock.sendall(b"t")
        except OSError:
            self.alone = True  # the partner is gone


def run_lockstep(script: str, first: dict, second: dict) -> list:
    """Runs `script --worker CFG` for both configurations at once, each in
    its own process with a Lockstep (cfg["lockstep"]) that its worker takes
    before each step and passes on after it: their steps alternate, `first`'s
    first. Returns both results, as run_worker does."""
    a, b = socket.socketpair()
    procs = []
    with tempfile.TemporaryDirectory() as d:
        try:
            for i, (cfg, sock) in enumerate(((first, a), (second, b))):
                cfg = dict(cfg, lockstep={"fd": sock.fileno(), "first": i == 0})
                cmd = [sys.executable, str(Path(script).resolve()), "--worker", json.dumps(cfg)]
                out, err = open(Path(d) / f"{i}.out", "w+"), open(Path(d) / f"{i}.err", "w+")
                procs.append(
                    (
                        cfg,
                        subprocess.Popen(
                            cmd, stdout=out, stderr=err, env=_worker_env(cfg.get("env")), pass_fds=(sock.fileno(),)
                        ),
                        out,
                        err,
                    )
                )
        finally:
            # Only the workers hold the socket's ends: one that exits is EOF to the other.
            a.close()
            b.close()
        results = []
        for cfg, p, out, err in procs:
            code = p.wait()
            out.seek(0)
            err.seek(0)
            results.append((cfg, out.read(), err.read(), code))
            out.close()
            err.close()
    return [_result(cfg.get("name", cfg), o, e, code, {}) for cfg, o, e, code in results]


def dd_rate(files) -> float:
    """Bytes/s of `dd iflag=direct` over `files`, one after another."""
    total, t = 0, time.perf_counter()
    for f in files:
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=8M", "iflag=direct"], check=True, capture_output=True)
        total += f.stat().st_size
    return total / (time.perf_counter() - t)


# (I/O threads, chunk bytes) tried by read_rate: the pager's own (4, 8 MiB)
# and its neighbours; the best is the device's rate at the pager's shape.
READ_SETTINGS = [(4, 8 << 20), (2, 8 << 20), (8, 8 << 20), (4, 2 << 20), (4, 32 << 20), (1, 32 << 20)]


def read_rate(
    files, page_bytes: int = 64 << 20, settings=READ_SETTINGS, max_seconds: float = 1.0, max_bytes: int = 1 << 30
):
    """The best direct-read rate (bytes/s) of `files` read as the pager reads
    them (mlx_pager._core.measure_read_rate: page_bytes batches, two in
    flight, chunks over several I/O threads, O_DIRECT), over `settings`.
    Returns (best, tried): tried has one dict per setting."""
    from mlx_pager._core import measure_read_rate

    tried = []
    for threads, chunk in settings:
        r = measure_read_rate(
            [str(f) for f in files],
            threads=threads,
            chunk_bytes=chunk,
            batch_bytes=max(1 << 20, int(page_bytes)),
            max_bytes=max_bytes,
            max_seconds=max_seconds,
        )
        if not r["direct"]:
            raise RuntimeError(
                f"{files[0]}: the file system refuses direct I/O, so a read rate would measure the page cache"
            )
        tried.append(r)
    return max(r["bytes_per_s"] for r in tried), tried

"""bench/benchlib.py: two workers in lockstep take turns, one step each,
never at once, the first's first; a partner that exits holds nothing back;
a configuration's environment variables reach its worker alone; the host's
steal is read from /proc/stat, and is None where there is none."""

import builtins
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from benchlib import cpu_steal_s, run_lockstep, run_worker  # noqa: E402

WORKER = """
import json, sys, time
sys.path.insert(0, {bench!r})
from benchlib import Lockstep
cfg = json.loads(sys.argv[2])
lock = Lockstep.from_cfg(cfg)
time.sleep(cfg["startup_s"])
ready = time.monotonic()
steps = []
for i in range(cfg["steps"]):
    lock.acquire()
    t = time.monotonic()
    time.sleep(0.05)
    steps.append([t, time.monotonic()])
    lock.turn()
print("RESULT " + json.dumps({{"steps": steps, "ready": ready}}))
"""


def worker_script(tmp_path) -> Path:
    p = tmp_path / "worker.py"
    p.write_text(WORKER.format(bench=str(Path(__file__).resolve().parents[2] / "bench")))
    return p


def spans(results):
    return sorted((t0, t1, who) for who, r in enumerate(results) for t0, t1 in r["steps"])


def test_steps_alternate_and_never_overlap(tmp_path):
    # The second starts later: the first's first step still waits for it.
    a, b = run_lockstep(
        str(worker_script(tmp_path)), dict(name="a", steps=4, startup_s=0.0), dict(name="b", steps=4, startup_s=0.5)
    )
    s = spans([a, b])
    assert [who for _, _, who in s] == [0, 1] * 4
    assert all(prev[1] <= nxt[0] for prev, nxt in zip(s, s[1:]))
    # the first's first step began once the second was ready (the clock is
    # the machine's, one for both processes)
    assert a["steps"][0][0] >= b["ready"]


def test_a_partner_that_is_done_holds_nothing_back(tmp_path):
    t = time.perf_counter()
    a, b = run_lockstep(
        str(worker_script(tmp_path)), dict(name="a", steps=2, startup_s=0.0), dict(name="b", steps=6, startup_s=0.0)
    )
    s = spans([a, b])
    assert [who for _, _, who in s] == [0, 1, 0, 1, 1, 1, 1, 1]
    assert all(prev[1] <= nxt[0] for prev, nxt in zip(s, s[1:]))
    assert time.perf_counter() - t < 30


ENV_WORKER = """
import json, os
print("RESULT " + json.dumps({"value": os.environ.get("MLX_PAGER_AB_PROBE"), "preload": os.environ.get("LD_PRELOAD")}))
"""


def test_a_configurations_env_reaches_its_worker_alone(tmp_path, monkeypatch):
    # --ab-env's rows: set where the process starts (OPENBLAS_THREAD_TIMEOUT
    # is read when OpenBLAS loads), not in the bench's own environment.
    monkeypatch.delenv("MLX_PAGER_AB_PROBE", raising=False)
    script = tmp_path / "env_worker.py"
    script.write_text(ENV_WORKER)
    assert run_worker(str(script), dict(name="a", env={"MLX_PAGER_AB_PROBE": "4"}))["value"] == "4"
    assert run_worker(str(script), dict(name="b"))["value"] is None
    a, b = run_lockstep(str(script), dict(name="a", env={"MLX_PAGER_AB_PROBE": "4"}), dict(name="b"))
    assert (a["value"], b["value"]) == ("4", None)
    assert "MLX_PAGER_AB_PROBE" not in __import__("os").environ


def test_steal_is_procs_eighth_field_in_seconds_or_none_without_it(monkeypatch, tmp_path):
    import os

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 900 3 0 1 250 0 0\ncpu0 50 0 25 450 1 0 0 125 0 0\n")
    real_open = builtins.open

    def fake(path, *a, **k):
        return real_open(stat if path == "/proc/stat" else path, *a, **k)

    monkeypatch.setattr(builtins, "open", fake)
    assert cpu_steal_s() == 250 / os.sysconf("SC_CLK_TCK")
    stat.write_text("cpu  100 0 50 900\n")  # a kernel without the field
    assert cpu_steal_s() is None
    stat.unlink()  # no /proc/stat (macOS)
    assert cpu_steal_s() is None

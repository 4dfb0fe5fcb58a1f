"""Where a compiled tail fits (jit.py): the memory limit read from the
process's cgroup (v1 and v2, the tightest of its ancestors), and the CPU
backend's compiler kept out of budgets a cap leaves no room beside."""

import mlx.core as mx
import pytest

from mlx_pager import jit


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_v2_limit_is_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path):
    proc = tmp_path / "proc_cgroup"
    write(proc, "0::/a/b\n")
    root = tmp_path / "cg"
    write(root / "a" / "b" / "memory.max", "max\n")
    write(root / "a" / "memory.max", "1000000000\n")
    write(root / "memory.max", "3000000000\n")
    assert jit.cgroup_limit(proc, root) == 1_000_000_000
    write(root / "a" / "b" / "memory.max", "500000000\n")
    assert jit.cgroup_limit(proc, root) == 500_000_000


def test_the_v1_limit_skips_the_unlimited_value(tmp_path):
    proc = tmp_path / "proc_cgroup"
    write(proc, "5:cpu:/\n4:memory:/x/y\n0::/\n")
    root = tmp_path / "cg"
    write(root / "memory" / "x" / "y" / "memory.limit_in_bytes", "9223372036854771712\n")
    write(root / "memory" / "x" / "memory.limit_in_bytes", "700000000\n")
    assert jit.cgroup_limit(proc, root) == 700_000_000
    write(root / "memory" / "x" / "memory.limit_in_bytes", "9223372036854771712\n")
    assert jit.cgroup_limit(proc, root) is None  # v1's "no limit" is no limit


def test_no_cgroup_no_limit(tmp_path):
    assert jit.cgroup_limit(tmp_path / "missing", tmp_path) is None
    write(tmp_path / "proc_cgroup", "0::/\n")
    assert jit.cgroup_limit(tmp_path / "proc_cgroup", tmp_path / "cg") is None


@pytest.mark.skipif(mx.default_device().type != mx.DeviceType.cpu, reason="the CPU backend's compiler")
def test_a_tail_is_compiled_on_the_cpu_only_with_room_for_the_compiler():
    budget = 1 << 30
    assert jit.tail_compile_refused(budget, limit=budget + jit.COMPILER_BYTES) is None
    why = jit.tail_compile_refused(budget, limit=budget + jit.COMPILER_BYTES - 1)
    assert why and "uncompiled" in why and "1.07GB" in why, why
    assert jit.tail_compile_refused(None, limit=budget) is None  # no budget to keep


def test_a_session_under_a_tight_limit_runs_its_tail_uncompiled(models, tmp_path, monkeypatch):
    """The session asks jit before it builds its Blocks: under a limit that
    leaves the compiler no room the tail is not compiled, with the same
    losses."""
    from test_session import run_one_step

    from mlx_pager import step

    made = []
    blocks = step.Blocks

    def spy(*a, **k):
        made.append(blocks(*a, **k))
        return made[-1]

    monkeypatch.setattr(step, "Blocks", spy)
    model = models("llama", None, hidden_size=256, intermediate_size=1024, num_hidden_layers=4)
    monkeypatch.setattr(jit, "memory_limit", lambda: None)  # whatever this machine has
    roomy = run_one_step(model, tmp_path, "roomy", memory_budget="2GB")
    monkeypatch.setattr(jit, "memory_limit", lambda: 2 * 10**9 + jit.COMPILER_BYTES - 1)
    tight = run_one_step(model, tmp_path, "tight", memory_budget="2GB")
    assert [b.tail.compile for b in made] == [True, mx.default_device().type != mx.DeviceType.cpu]
    assert tight.train_losses == roomy.train_losses

"""Atomic saves: a failed, killed or out-of-space write never destroys the
previous good file, and says which file and why."""

import os
import signal
import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest

from mlx_pager import files


def test_failed_write_keeps_the_previous_file(tmp_path):
    path = tmp_path / "adapters.safetensors"
    files.save_safetensors(path, {"a": mx.ones((4,))})

    def broken(tmp):
        open(tmp, "wb").write(b"partial")
        raise RuntimeError("[write] Unable to write 2886 bytes to file.")

    with pytest.raises(files.SaveError) as e:
        files.atomic_write(path, broken)
    assert str(path) in str(e.value) and "free" in str(e.value)
    assert mx.array_equal(mx.load(str(path))["a"], mx.ones((4,))).item()
    assert [p.name for p in tmp_path.iterdir()] == ["adapters.safetensors"]  # no temporary left


def test_kill_9_while_writing_keeps_the_previous_file(tmp_path):
    path = tmp_path / "adapters.safetensors"
    files.save_safetensors(path, {"a": mx.zeros((8,))})
    child = textwrap.dedent(f"""
        import time
        from mlx_pager import files
        def slow(tmp):
            f = open(tmp, "wb"); f.write(b"x" * 4096); f.flush()
            print("writing", flush=True); time.sleep(60)
        files.atomic_write({str(path)!r}, slow)
    """)
    p = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "writing"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert mx.array_equal(mx.load(str(path))["a"], mx.zeros((8,))).item()
    assert len(list(tmp_path.iterdir())) == 2  # the killed writer's temporary
    files.save_safetensors(path, {"a": mx.ones((8,))})  # the next save removes it
    assert [p.name for p in tmp_path.iterdir()] == ["adapters.safetensors"]


def test_full_disk_is_named_with_bytes_needed_and_free(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        path = mnt / "adapters.safetensors"
        files.save_safetensors(path, {"a": mx.zeros((16,))})
        with pytest.raises(files.SaveError) as e:
            files.save_safetensors(path, {"a": mx.zeros((1 << 20,))})  # 4 MB into 256 KB
        msg = str(e.value)
        assert str(path) in msg and "needs 4.2" in msg and "free" in msg
        assert mx.array_equal(mx.load(str(path))["a"], mx.zeros((16,))).item()
        # A write that runs out of space midway (the estimate said it fits).
        with pytest.raises(files.SaveError) as e:
            files.atomic_write(path, lambda tmp: open(tmp, "wb").write(b"x" * (1 << 20)), expected_bytes=1)
        assert "disk is full" in str(e.value)
        assert [p.name for p in mnt.iterdir()] == ["adapters.safetensors"]
    finally:
        subprocess.run(["umount", str(mnt)])

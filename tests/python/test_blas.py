"""blas.py: OpenBLAS for MLX's Linux CPU wheel, and its threads shared
between ranks on one machine (the preload itself: test_lora_cli.py)."""

import json
import os
import subprocess
import sys

import pytest

from mlx_pager import blas


def ring_hostfile(tmp_path, hosts):
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(hosts))
    return str(path)


def test_ring_ranks_on_this_host_are_those_at_this_ranks_ip(tmp_path):
    # mlx.launch's ring hostfile: one entry per rank, its "ip:port"s.
    path = ring_hostfile(tmp_path, [["127.0.0.1:5000"], ["127.0.0.1:5001"], ["10.0.0.2:5002", "10.0.1.2:5003"]])
    assert blas.ranks_on_this_host({"MLX_HOSTFILE": path, "MLX_RANK": "0"}) == 2
    assert blas.ranks_on_this_host({"MLX_HOSTFILE": path, "MLX_RANK": "1"}) == 2
    assert blas.ranks_on_this_host({"MLX_HOSTFILE": path, "MLX_RANK": "2"}) == 1
    flat = ring_hostfile(tmp_path, ["127.0.0.1:5000", "127.0.0.1:5001"])
    assert blas.ranks_on_this_host({"MLX_HOSTFILE": flat, "MLX_RANK": "1"}) == 2


def test_mpi_says_its_local_size():
    assert blas.ranks_on_this_host({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) == 4


def test_one_rank_where_nothing_says_otherwise(tmp_path):
    assert blas.ranks_on_this_host({}) == 1
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    assert blas.ranks_on_this_host({"MLX_HOSTFILE": str(bad), "MLX_RANK": "0"}) == 1
    path = ring_hostfile(tmp_path, [["127.0.0.1:5000"]])
    assert blas.ranks_on_this_host({"MLX_HOSTFILE": path, "MLX_RANK": "3"}) == 1
    assert blas.ranks_on_this_host({"MLX_HOSTFILE": str(tmp_path / "missing"), "MLX_RANK": "0"}) == 1


SHARE = """
import ctypes, json, os, sys
import mlx_pager, mlx_pager.blas as b
got = b.share_cores(json.loads(sys.argv[1]))
lib = ctypes.CDLL(b.openblas_path())
print(json.dumps([got, lib.openblas_get_num_threads(), len(os.sched_getaffinity(0))]))
"""


@pytest.mark.skipif(blas.openblas_path() is None, reason="OpenBLAS is not installed")
def test_ranks_on_one_machine_share_its_cores_unless_the_user_set_threads(tmp_path):
    path = ring_hostfile(tmp_path, [["127.0.0.1:5000"], ["127.0.0.1:5001"]])
    env = {"MLX_HOSTFILE": path, "MLX_RANK": "1"}
    clean = {k: v for k, v in os.environ.items() if k not in blas.THREAD_VARS}

    def run(rank_env):
        out = subprocess.run(
            [sys.executable, "-c", SHARE, json.dumps(rank_env)], env=clean, capture_output=True, text=True, check=True
        )
        return json.loads(out.stdout)

    got, threads, cores = run(env)
    assert got == threads == max(1, cores // 2)
    got, threads, cores = run(dict(env, OPENBLAS_NUM_THREADS="2"))  # the user's choice stands
    assert got is None and threads == cores
    got, threads, cores = run({})  # one rank: every core
    assert got is None and threads == cores

"""The communicator's collectives on real gloo ranks, against gloo's own."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

HERE = Path(__file__).parent
DTYPES = ("float64", "float32", "bfloat16")


def run_ranks(tmp_path, world_size):
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "comm_script.py"),
                str(tmp_path),
                str(rank),
                str(world_size),
            ],
            env=env,
        )
        for rank in range(world_size)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0] * world_size
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world_size)]


def test_two_ranks_sum_and_gather_as_gloo_does_bit_for_bit(tmp_path):
    """Two ranks exchange one message each way; both hold gloo's sum, bit for bit.

    (More ranks use gloo's collectives: test_more_ranks_than_features_fit_the_same_model.)
    """
    world_size = 2
    ranks = run_ranks(tmp_path, world_size)
    assert [out["peer"] for out in ranks] == [1, 0]  # the exchange is taken
    for name in DTYPES:
        mines = [out[name]["mine"] for out in ranks]
        for rank, out in enumerate(ranks):
            torch.testing.assert_close(out[name]["summed"], out[name]["by_gloo"], rtol=0, atol=0)
            # Every rank holds the same bits (the replicated steps depend on it).
            torch.testing.assert_close(
                out[name]["summed"], ranks[0][name]["summed"], rtol=0, atol=0
            )
            torch.testing.assert_close(out[name]["gathered"], torch.cat(mines), rtol=0, atol=0)
            torch.testing.assert_close(
                out[name]["gathered"], out[name]["gathered_by_gloo"], rtol=0, atol=0
            )
            assert out[name]["sent_unchanged"], (rank, name)
        # The order of two additions cannot matter: a + b is b + a.
        torch.testing.assert_close(ranks[0][name]["summed"], mines[0] + mines[1], rtol=0, atol=0)
    # 3 all-reduces and all-gathers, then the barrier's all-reduce of one value.
    n = 3001
    payload = sum(
        n * (1 + world_size) * torch.empty(0, dtype=getattr(torch, d)).element_size()
        for d in DTYPES
    )
    assert [out["n_allreduce"] for out in ranks] == [7] * world_size
    # The core is yielded after posting each collective (7) and after the
    # barrier's blocking all-reduce (1), not after the waits for started
    # all-reduces and all-gathers, which the engine overlaps.
    assert [out["yields"] for out in ranks] == [8] * world_size
    # Kept while the transport is timed, and by a rank told not to (beside busy processes).
    assert [out["yields_keeping_the_core"] for out in ranks] == [0] * world_size
    assert [out["yields_switched_off"] for out in ranks] == [0] * world_size
    assert [out["yields_after"] for out in ranks] == [2] * world_size  # posting, blocking wait
    assert [out["allreduce_bytes"] for out in ranks] == [payload + 4] * world_size

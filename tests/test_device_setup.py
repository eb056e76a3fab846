"""Choices a CUDA fit makes before any kernel runs, tested on the CPU.

Which GPU a rank of a ``"world"`` fit takes, which ranks share one, whom a
watchdog abort blames, and the float32 matmul precision a fit pins.
"""

import pytest
import torch

from sklearn_casgd._distributed.failures import exit_error
from sklearn_casgd._distributed.launch import rank_device
from sklearn_casgd._distributed.world import duplicate_ranks, local_cuda_device
from sklearn_casgd._engine.precision import PRESETS, matmul_precision


@pytest.mark.parametrize(
    "env, rank, count, expected",
    [
        ({"LOCAL_RANK": "1"}, 5, 4, 1),  # torchrun: the local rank, not the global one
        ({"SLURM_LOCALID": "2"}, 6, 4, 2),
        ({}, 3, 4, 3),  # one node, nothing set: the global rank
        ({"LOCAL_RANK": "3"}, 3, 1, 0),  # one visible GPU per task
    ],
)
def test_a_world_rank_takes_its_local_gpu(env, rank, count, expected):
    assert local_cuda_device(env, rank, count) == torch.device("cuda", expected)


@pytest.mark.parametrize(
    "env, rank, message",
    [
        ({"LOCAL_RANK": "4"}, 0, "device 4 \\(LOCAL_RANK\\)"),
        ({}, 9, "device 9 \\(the global rank"),
    ],
)
def test_a_rank_without_a_gpu_of_its_own_is_a_clear_error(env, rank, message):
    with pytest.raises(ValueError, match=message):
        local_cuda_device(env, rank, 4)


@pytest.mark.parametrize(
    "device, rank, world_size, count, expected",
    [
        ("cpu", 1, 2, 0, "cpu"),
        ("cuda", 0, 1, 1, "cuda:0"),
        ("cuda", 1, 2, 2, "cuda:1"),
        ("cuda:1", 0, 1, 2, "cuda:1"),  # the estimator's device, not rank 0's cuda:0
        ("cuda:1", 1, 2, 3, "cuda:2"),
    ],
)
def test_a_pool_rank_takes_the_estimators_device_onwards(device, rank, world_size, count, expected):
    assert rank_device(device, rank, world_size, count) == torch.device(expected)


@pytest.mark.parametrize("device, world_size, count", [("cuda", 2, 1), ("cuda:1", 1, 1)])
def test_a_pool_without_a_device_for_each_rank_is_a_clear_error(device, world_size, count):
    with pytest.raises(ValueError, match=f"n_devices={world_size} from cuda"):
        rank_device(device, 0, world_size, count)


def test_ranks_sharing_a_device_are_named():
    assert duplicate_ranks([11, 12, 11, 13]) == [0, 2]
    assert duplicate_ranks([1, 2, 3]) == []


def test_a_watchdog_abort_blames_the_silent_peer():
    tail = "[rank0]:[E] Watchdog caught collective operation timeout: WorkNCCL(...) ran for 5000 ms"
    rank, details = exit_error(0, -6, tail, silent=[1])
    assert rank == 1
    assert "rank 0 was aborted by the collective watchdog" in details and tail in details


def test_an_exit_without_a_timeout_blames_the_rank_that_exited():
    assert exit_error(1, -9, "Killed", silent=[0])[0] == 1
    assert exit_error(1, 1, "Timed out", silent=[0])[0] == 1  # an ordinary exit, not an abort


def test_fits_on_cuda_pin_float32_matmuls_to_ieee_and_restore_the_setting():
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"
        with matmul_precision(PRESETS["fp32"], torch.device("cuda")):
            assert matmul.fp32_precision == "ieee"
        assert matmul.fp32_precision == "tf32"
        with matmul_precision(PRESETS["fp32"], torch.device("cpu")):
            assert matmul.fp32_precision == "tf32"  # CPU fits leave it alone
    finally:
        matmul.fp32_precision = saved

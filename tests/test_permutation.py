"""The epoch order computed on the device: a Feistel permutation with cycle walking."""

import numpy as np
import pytest
import torch

from sklearn_casgd import CASGDLogisticRegression
from sklearn_casgd._engine import execution
from sklearn_casgd._engine.permutation import ROUNDS, draw_keys, feistel_order
from sklearn_casgd.datasets import make_glm_data

KEYS = [0x9E3779B9, 0x12345678, 0xDEADBEEF, 0x0BADF00D]


def reference_order(n_samples, keys):
    """The same permutation one Python integer at a time (no tensors, no masking tricks)."""
    half = ((n_samples - 1).bit_length() + 1) // 2
    low = (1 << half) - 1

    def mix(x, key):
        x ^= key
        x = (x * 0x7FEB352D) % 2**32
        x ^= x >> 15
        x = (x * 0x2C1B3C6D) % 2**32
        return x ^ (x >> 16)

    def network(x):
        left, right = x >> half, x & low
        for key in keys:
            left, right = right, left ^ (mix(right, key) & low)
        return (left << half) | right

    order = []
    for i in range(n_samples):
        value = network(i)
        while value >= n_samples:  # cycle walking
            value = network(value)
        order.append(value)
    return order


@pytest.mark.parametrize("n_samples", [2, 3, 5, 16, 17, 1000, 4097, 65537])
def test_the_order_is_the_reference_permutation(n_samples):
    """Just above powers of four, most values start outside and walk several times."""
    order = feistel_order(n_samples, KEYS, torch.device("cpu"), torch.int32)
    assert order.dtype == torch.int32
    assert order.tolist() == reference_order(n_samples, KEYS)
    assert np.array_equal(np.sort(order.numpy()), np.arange(n_samples))


def test_small_orders_and_other_keys():
    cpu = torch.device("cpu")
    assert feistel_order(0, KEYS, cpu).numel() == 0
    assert feistel_order(1, KEYS, cpu).tolist() == [0]
    first = feistel_order(1000, KEYS, cpu)
    second = feistel_order(1000, KEYS[::-1], cpu)
    assert not torch.equal(first, second)
    assert not torch.equal(first, torch.arange(1000))


def test_keys_come_from_the_fits_generator():
    generator = torch.Generator().manual_seed(3)
    keys = draw_keys(generator)
    assert len(keys) == ROUNDS and all(0 <= key < 2**32 for key in keys)
    assert draw_keys(torch.Generator().manual_seed(3)) == keys
    assert draw_keys(generator) != keys  # the next epoch's


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_device_computes_the_cpus_order():
    cpu = feistel_order(1_000_003, KEYS, torch.device("cpu"))
    cuda = feistel_order(1_000_003, KEYS, torch.device("cuda"))
    assert torch.equal(cuda.cpu(), cpu)


def test_a_fit_on_the_device_order(monkeypatch):
    """The order a CUDA fit draws, taken on the CPU: its own batches, the same optimum.

    Plain SGD's one epoch moves differently from randperm's order; SVRG ends
    at the optimum either way, and a fit is reproducible from its seed.
    """
    X, y, _ = make_glm_data("logistic", 500, 6, random_state=0)
    sgd = dict(solver="sgd", batch_size=16, max_iter=1, tol=None, precision="fp64")
    svrg = dict(batch_size=16, s=1, tol=1e-8, precision="fp64", max_iter=200)
    randperm_sgd = CASGDLogisticRegression(random_state=0, **sgd).fit(X, y)
    randperm_svrg = CASGDLogisticRegression(random_state=0, **svrg).fit(X, y)
    monkeypatch.setitem(execution.DEVICE_ORDER, "cpu", True)
    feistel_sgd = CASGDLogisticRegression(random_state=0, **sgd).fit(X, y)
    again = CASGDLogisticRegression(random_state=0, **sgd).fit(X, y)
    feistel_svrg = CASGDLogisticRegression(random_state=0, **svrg).fit(X, y)
    assert np.abs(feistel_sgd.coef_ - randperm_sgd.coef_).max() > 1e-6
    np.testing.assert_array_equal(again.coef_, feistel_sgd.coef_)
    assert feistel_svrg.fit_stats_["converged"] and randperm_svrg.fit_stats_["converged"]
    np.testing.assert_allclose(feistel_svrg.coef_, randperm_svrg.coef_, rtol=0, atol=1e-6)

"""A counter-based permutation of the rows, computed where the rows are.

``torch.randperm`` draws an epoch's order on the CPU, one element after
another; an epoch on a GPU then waits for it and for its copy. A Feistel
network over ``2h`` bits is a bijection of ``[0, 4^h)`` whatever its round
function; cycle walking (applying it again to the values ``>= n``)
restricts it to a bijection of ``[0, n)``. Every value is computed from
its own index and the round keys alone, so the order is computed on the
device in a few elementwise passes, and it is the same on every device
from the same keys.

The round function mixes 32-bit words with multiply-xorshift steps (as
the finalizers of integer hashes do). The arithmetic is in int64, masked
to 32 bits after each product, and every multiplier is below 2^31: no
product overflows, so every device computes the same values.
"""

from __future__ import annotations

import torch

# Rounds of the Feistel network: four with pseudorandom round functions
# give a pseudorandom permutation (Luby and Rackoff).
ROUNDS = 4
_MASK32 = 0xFFFFFFFF
_MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D)


def draw_keys(generator: torch.Generator) -> list[int]:
    """One epoch's round keys, 32-bit, from ``generator`` (on the CPU)."""
    return torch.randint(0, 1 << 32, (ROUNDS,), generator=generator).tolist()


def _mix(x: torch.Tensor, key: int) -> torch.Tensor:
    """The round function: a 32-bit mix of ``x`` (values below 2^32) and ``key``."""
    x = x ^ key
    x = (x * _MULTIPLIERS[0]) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MULTIPLIERS[1]) & _MASK32
    return x ^ (x >> 16)


def _network(x: torch.Tensor, half_bits: int, keys: list[int]) -> torch.Tensor:
    """The Feistel network on values of ``2 * half_bits`` bits."""
    mask = (1 << half_bits) - 1
    left, right = x >> half_bits, x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right, key) & mask)
    return (left << half_bits) | right


def feistel_order(
    n_samples: int, keys: list[int], device: torch.device, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """A permutation of ``range(n_samples)`` from ``keys``, computed on ``device``.

    Position i holds the network's image of i, walked until it is below
    ``n_samples``: at most a quarter of the values start outside, and each
    walk keeps a value outside with probability below 3/4.
    """
    if n_samples <= 1:
        return torch.arange(n_samples, dtype=dtype, device=device)
    half_bits = ((n_samples - 1).bit_length() + 1) // 2
    order = _network(torch.arange(n_samples, device=device), half_bits, keys)
    outside = torch.nonzero(order >= n_samples).squeeze(1)
    while outside.numel():
        order[outside] = _network(order[outside], half_bits, keys)
        outside = outside[order[outside] >= n_samples]
    return order.to(dtype)

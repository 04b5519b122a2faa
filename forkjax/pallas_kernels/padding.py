"""Shape helpers of the kernel wrappers: Triton blocks want power-of-two sizes, so arrays are
zero-padded up to them (a copy; the fast paths use shapes that need none)."""

import jax.numpy as jnp


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x - 1).bit_length())


def pad_axis(x, axis: int, size: int):
    """Zero-pad `axis` of x up to `size` (x itself when it is that size already)."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def flat_rows(pool, width: int):
    """[(L,) P, S, X] -> [(L,) P*S, width]: token rows for the kernels' row gathers (a free
    reshape when X == width)."""
    x = pad_axis(pool, -1, width)
    return x.reshape(x.shape[:-3] + (-1, width))

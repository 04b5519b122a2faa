"""Plain-jnp references of the SGMV kernels (triton.py): each token gathers its own slot's
weights (T·Rp·d elements, which the kernels never build). Padding rows (slot N) give zeros."""

from __future__ import annotations

import jax.numpy as jnp


def _own(w, slots):
    """w [N, Rp, d], slots [T] -> each token's slot of w [T, Rp, d] (zeros for slot N)."""
    n = w.shape[0]
    return jnp.where((slots < n)[:, None, None], w[jnp.minimum(slots, n - 1)], 0)


def sgmv_shrink_reference(x, a, slots):
    """x [T, d_in], a [N, Rp, d_in], slots [T] -> [T, Rp] in x's dtype (float32 products)."""
    xa = jnp.einsum("td,trd->tr", x.astype(jnp.float32), _own(a, slots).astype(jnp.float32),
                    precision="highest")
    return xa.astype(x.dtype)


def sgmv_expand_reference(xa, b, slots):
    """xa [T, Rp], b [N, Rp, d_out], slots [T] -> [T, d_out] in xa's dtype (float32 products)."""
    y = jnp.einsum("tr,tro->to", xa.astype(jnp.float32), _own(b, slots).astype(jnp.float32),
                   precision="highest")
    return y.astype(xa.dtype)

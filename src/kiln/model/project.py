"""Weight projections whose weight gradient is computed, and so reduced across devices, in a
chosen dtype (`train.grad_reduce_dtype`).

Under data or fsdp parallelism each device's weight gradient is a partial sum over its tokens;
XLA's partitioner sums the partials (all-reduce / reduce-scatter) right where the gradient's
matmul produces them, in that matmul's output dtype, which is the compute dtype. Casting the
gradient afterwards cannot change that dtype, so `project` computes the weight gradient's
matmul with `preferred_element_type` set to the reduce dtype instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kiln.parallel.mesh import current_reduce_dtype


def project(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, x, w)` ("inputs,weight->output"); its weight gradient in the reduce dtype."""
    dtype = current_reduce_dtype()
    if dtype is None or dtype == jnp.result_type(x, w):
        return jnp.einsum(spec, x, w)  # the reduce dtype is the compute dtype: nothing to change
    return _project(spec, dtype, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _project(spec, dtype, x, w):
    return jnp.einsum(spec, x, w)


def _project_fwd(spec, dtype, x, w):
    return jnp.einsum(spec, x, w), (x, w)


def _project_bwd(spec, dtype, residuals, g):
    x, w = residuals
    inputs, rest = spec.split(",")
    weight, output = rest.split("->")
    dx = jnp.einsum(f"{output},{weight}->{inputs}", g, w)
    # Rounded to w's dtype only after the cross-device sum XLA places at this matmul.
    dw = jnp.einsum(f"{inputs},{output}->{weight}", x, g, preferred_element_type=dtype)
    return dx, dw.astype(w.dtype)


_project.defvjp(_project_fwd, _project_bwd)

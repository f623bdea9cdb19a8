"""Decode steps of a run of layers in one `lax.scan`, each layer's cache written in place.

A model's decode step unrolled over its N layers compiles N copies of every layer's ops (large
programs on XLA:CPU: results/sweep.md); a `lax.scan` over the layers compiles one copy. But the
plain scan body -- slice layer i's state out of the stacked carry, run the method's decode step,
write the new state back -- copies each layer's whole cache every step: XLA does not see that
only one row changed (docs/generation.md#models-and-generation).

`scan_layers` threads the stacked carry through the body instead. Layer i's state holds *views*
of the stacked leaves (`dynamic_index_in_dim` at i); reads through a view fuse into their
consumers (gathers, reductions), as reads of a per-layer buffer do. Writes go through
`write_rows`, the cache's one primitive that writes storage rows (`cache.append`, the stage-2
states' appends): given a view, it writes into the stacked leaf at `[i, ...]` -- an in-place
dynamic-update-slice of the carry -- and returns a view of the result. At the end of the body a
leaf that is the latest view of its own stacked leaf is carried as it is; any other leaf (the
per-sequence counters, or anything a method rebuilt) is written back with one
dynamic-update-slice at i. The results are the same either way; only the cost differs.

The views are ordinary traced arrays: the methods' code needs no change and cannot tell.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

_LOCAL = threading.local()  # the active scope of the body being traced (compiles run in threads)


class _Scope:
  """The stacked leaves of one scan body's trace and their latest views at the layer index."""

  def __init__(self, layer: jax.Array, stacks: list):
    self.layer = layer
    self.stacks = stacks
    self.views: list[Any] = [None] * len(stacks)  # the latest view of each stacked leaf
    self.leaf: dict[int, int] = {}  # id(a view ever made) -> its leaf index

  def view(self, j: int) -> jax.Array:
    v = lax.dynamic_index_in_dim(self.stacks[j], self.layer, 0, keepdims=False)
    self.views[j] = v
    self.leaf[id(v)] = j
    return v

  def leaf_of(self, x) -> int | None:
    """The leaf index when `x` is the latest view of a stacked leaf, else None."""
    j = self.leaf.get(id(x))
    return j if j is not None and self.views[j] is x else None


@contextlib.contextmanager
def _active(scope: _Scope):
  outer = getattr(_LOCAL, "scope", None)
  _LOCAL.scope = scope
  try:
    yield
  finally:
    _LOCAL.scope = outer


@contextlib.contextmanager
def suspended():
  """No active scope inside: `write_rows` writes the buffer it is given (for code traced in a
  nested trace, such as a `lax.cond` branch, which must not write the scan's stacked carry)."""
  with _active(None):
    yield


def write_rows(buf: jax.Array, write: Callable[[jax.Array, tuple], jax.Array]) -> jax.Array:
  """`write(target, lead)` -> the updated target, where `lead` is the index tuple to put before
  `buf`'s own indices: `()` and `target = buf` normally; `(layer,)` and the stacked leaf when
  `buf` is the latest view of one in an active `scan_layers` body. Returns `buf` updated."""
  scope = getattr(_LOCAL, "scope", None)
  j = scope.leaf_of(buf) if scope is not None else None
  if j is None:
    return write(buf, ())
  scope.stacks[j] = write(scope.stacks[j], (scope.layer,))
  return scope.view(j)


def scan_layers(fn: Callable, carry, states, layers: jax.Array, index: jax.Array | None = None):
  """Runs `fn(carry, state, layer) -> (carry, state)` over stacked per-layer states.

  Args:
    fn: one layer's step; `state` is that layer's state (views: see the module doc), `layer`
      the traced entry of `layers`.
    carry: pytree threaded through the layers (the hidden state).
    states: pytree whose leaves are `[n, ...]`: n layers' states of one structure.
    layers: `[n]` int32, handed to `fn` (e.g. absolute layer indices for the weights).
    index: `[n]` int32 entries of the stack to run, in order (default all of them, `0..n-1`):
      a part of a stack whose other layers another loop runs, on the same stacked buffers.
  Returns:
    (carry after the n layers, the updated stacked states).
  """
  leaves, treedef = jax.tree_util.tree_flatten(states)

  def body(c, inp):
    stacks, carry = c
    i, layer = inp
    scope = _Scope(i, list(stacks))
    views = [scope.view(j) for j in range(len(leaves))]
    with _active(scope):
      carry, new = fn(carry, jax.tree_util.tree_unflatten(treedef, views), layer)
    new_leaves, new_def = jax.tree_util.tree_flatten(new)
    if new_def != treedef:
      raise ValueError(f"fn must return a state of the structure it was given: {treedef} -> "
                       f"{new_def}")
    out = []
    for j, leaf in enumerate(new_leaves):
      if scope.leaf_of(leaf) == j:
        out.append(scope.stacks[j])
      else:
        out.append(lax.dynamic_update_index_in_dim(
            scope.stacks[j], leaf.astype(scope.stacks[j].dtype), i, 0))
    return (tuple(out), carry), None

  n = layers.shape[0]
  index = jnp.arange(n, dtype=jnp.int32) if index is None else index
  (stacks, carry), _ = lax.scan(body, (tuple(leaves), carry), (index, layers))
  return carry, jax.tree_util.tree_unflatten(treedef, list(stacks))

"""The serving engine's compiled programs over a batch of `S` decode slots.

    state = init_program(params, ...)                    # [S] rows of well-formed KV states
    first, state = admit_program(params, state, tokens [1, L], length [1], slot, ...)
    tokens [S, K], state = decode_program(params, state, last [S], positions [S], ...)

    # or the prefill in layer groups [b0, b1), ..., [b_{G-1}, N) (EngineConfig.prefill_layer_groups)
    x, part = prefill_group_program(params, tokens [1, L], length [1], lo=0, hi=b1)
    x, part = prefill_group_program(params, x [1, L, D], length [1], lo=b1, hi=b2)  # ...
    first, state = admit_program(params, state, (x, parts), length [1], slot, ..., lo=b_{G-1})

`admit_program` prefills one request (its prompt right-padded to a length bucket `L`) with the
engine's one `Plan` and writes its per-layer states into row `slot` of the batch state (donated,
so in place); `decode_program` runs `K` decode steps of every slot. In layer groups, each
group's call carries only the hidden states `x` to the next; the stage-1 states of its layers
are final and wait (`part`) until the last call joins them into the same row state. The states
of every request have the same shapes because they share the plan, so the programs compile
once per bucket (admit; G times in G layer groups) and once (decode), whatever the requests'
lengths.

Sampling is per row (`sample_rows`): each slot has its own temperature, top-p, seed and
min_tokens; temperature 0 is argmax, as `rocketkv.generate`'s greedy decoding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from rocketkv_jax.models import llama
from rocketkv_jax.models.precision import compute_params
from rocketkv_jax.runtime import paged_pool


def sample_rows(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, keys: jax.Array,
                ban: jax.Array) -> jax.Array:
  """One token per row of `logits [S, V]`: argmax where `temperature [S]` is 0, else a sample
  of softmax(logits / temperature) restricted to the top-`top_p [S]` nucleus with the row's
  key (`keys [S, 2]` uint32). `ban [S, V]` bool: tokens the row may not sample (EOS before
  its min_tokens)."""
  logits = jnp.where(ban, -jnp.inf, logits.astype(jnp.float32))
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def sample(logits):
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]  # at least the top token
    cutoff = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    scaled = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
    sampled = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return jnp.where(temperature == 0, greedy, sampled)

  # the vocabulary sort only when some row samples: an all-greedy batch costs one argmax
  return lax.cond(jnp.any(temperature > 0), sample, lambda _: greedy, logits)


def _ban(eos: jax.Array, n_generated: jax.Array, min_tokens: jax.Array, vocab: int):
  """[S, V] bool: the EOS ids of rows that have generated fewer than their min_tokens."""
  is_eos = jnp.zeros((vocab,), bool).at[eos].set(True, mode="drop")
  return (n_generated < min_tokens)[:, None] & is_eos[None, :]


def _keys(seeds: jax.Array, n_generated: jax.Array) -> jax.Array:
  """Row keys `[S, 2]`: the row's seed folded with the index of the token it samples."""
  return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seeds, n_generated)


def batch_axis(state: llama.LayerStack):
  """Per group of a `LayerStack`: the batch axis of its leaves (1 for a stacked run of layers,
  0 for a layer alone)."""
  return tuple(1 if hi - lo > 1 else 0 for lo, hi in state.spans)


def write_row(state: llama.LayerStack, row: llama.LayerStack, slot: jax.Array):
  """`state` with batch row `slot` replaced by the one row of `row` (same structure)."""
  groups = []
  for axis, g, r in zip(batch_axis(state), state.groups, row.groups):
    groups.append(jax.tree.map(
        lambda a, b, axis=axis: lax.dynamic_update_index_in_dim(a, b.astype(a.dtype), slot, axis),
        g, r))
  return state.replace(groups=tuple(groups))


def tile_rows(row: llama.LayerStack, slots: int):
  """A batch state of `slots` copies of the one row of `row`."""
  groups = []
  for axis, g in zip(batch_axis(row), row.groups):
    groups.append(jax.tree.map(lambda a, axis=axis: jnp.repeat(a, slots, axis=axis), g))
  return row.replace(groups=tuple(groups))


def _prefill(params, tokens, lengths, *, config, plan, block_size, impl):
  return llama.prefill(params, tokens, lengths, config=config, plan=plan,
                       block_size=block_size, impl=impl, stacked=True)


def init_program(params, tokens, lengths, *, config, plan, slots, block_size, impl):
  """The initial batch state: `slots` copies of the state of a one-token prompt (so an idle
  slot decodes well-formed numbers)."""
  _, state = _prefill(params, tokens, lengths, config=config, plan=plan, block_size=block_size,
                      impl=impl)
  return tile_rows(state, slots)


def _first_token(logits, temperature, top_p, seed, min_tokens, eos):
  """The first token `[1]` of a request from its prompt's last logits `[1, V]`."""
  zero = jnp.zeros((1,), jnp.int32)
  return sample_rows(logits, temperature, top_p, _keys(seed, zero),
                     _ban(eos, zero, min_tokens, logits.shape[-1]))


def _prefill_or_last(params, inputs, lengths, *, config, plan, block_size, impl, lo):
  """(logits [1, V], the request's row state): the whole prefill of tokens `inputs` (lo = 0),
  or its last layer group [lo, N) from `inputs = (x [1, L, D], parts)` joined with the parts."""
  if lo == 0:
    return _prefill(params, inputs, lengths, config=config, plan=plan, block_size=block_size,
                    impl=impl)
  x, parts = inputs
  logits, part = llama.prefill_layers(params, x, lengths, lo, config.num_layers, config=config,
                                      plan=plan, block_size=block_size, impl=impl)
  return logits, llama.join_layer_stacks(tuple(parts) + (part,),
                                         llama.prefill_spans(config, plan))


def prefill_group_program(params, inputs, lengths, *, config, plan, block_size, impl, lo, hi):
  """Layers [lo, hi) (hi < N) of one prompt's prefill: `inputs` its tokens `[1, L]` (lo = 0)
  or the hidden states `[1, L, D]` entering layer lo. Returns (the hidden states entering layer
  hi, the stage-1 states of layers [lo, hi): a `LayerStack` part, `llama.prefill_layers`)."""
  x = llama.embed(compute_params(params), config, inputs) if lo == 0 else inputs
  return llama.prefill_layers(params, x, lengths, lo, hi, config=config, plan=plan,
                              block_size=block_size, impl=impl)


def admit_program(params, state, tokens, lengths, slot, temperature, top_p, seed, min_tokens,
                  eos, *, config, plan, block_size, impl, lo=0):
  """Prefills one prompt `tokens [1, L]` (`lengths [1]` valid) into row `slot` of `state`
  (donated) and samples its first token. Returns (token [1] int32, state). With lo > 0 it is
  the last layer group [lo, N) of a prompt prefilled in groups: `tokens` is `(x [1, L, D],
  parts)` from the groups before it, and the row state is theirs joined as the one-call
  prefill makes it (`llama.join_layer_stacks`)."""
  logits, row = _prefill_or_last(params, tokens, lengths, config=config, plan=plan,
                                 block_size=block_size, impl=impl, lo=lo)
  first = _first_token(logits, temperature, top_p, seed, min_tokens, eos)
  return first, write_row(state, row, slot)


def init_paged_program(params, tokens, lengths, *, config, plan, slots, num_pages, page_size,
                       pages_per_seq, sliding_groups, block_size, impl):
  """The initial paged pool (`paged_pool.empty_pool`) around a one-token prompt's state."""
  _, row = _prefill(params, tokens, lengths, config=config, plan=plan, block_size=block_size,
                    impl=impl)
  return paged_pool.empty_pool(row, slots, num_pages, page_size, pages_per_seq, sliding_groups)


def admit_paged_program(params, state, tokens, lengths, slot, page_ids, temperature, top_p, seed,
                        min_tokens, eos, *, config, plan, sliding_groups, block_size, impl, lo=0):
  """`admit_program` into a paged pool: the request's rows go to pages `page_ids [NP]`.
  Returns (token [1], the most tokens a layer kept (the engine checks its pages hold them),
  state). With lo > 0, the last layer group's call: `tokens` is `(x, parts)`."""
  logits, row = _prefill_or_last(params, tokens, lengths, config=config, plan=plan,
                                 block_size=block_size, impl=impl, lo=lo)
  first = _first_token(logits, temperature, top_p, seed, min_tokens, eos)
  return (first, paged_pool.kept_tokens(row, sliding_groups),
          paged_pool.write_request(state, row, slot, page_ids, sliding_groups))


def release_program(state, free, *, sliding_groups, **_):
  """The slots where `free [S]` holds lose their pages (`paged_pool.release`)."""
  return paged_pool.release(state, free, sliding_groups)


def tables_program(state, rows, mask, *, sliding_groups, **_):
  """The slots where `mask [S]` holds get the page tables `rows [S, NP]` (`paged_pool.
  set_tables`): a lazily paged request's pages as it grows, or none once it is preempted."""
  return paged_pool.set_tables(state, rows, mask, sliding_groups)


def decode_program(params, state, last, positions, n_generated, temperature, top_p, seed,
                   min_tokens, eos, *, config, plan, steps, impl):
  """`steps` decode steps of every slot. `last [S]`: each slot's last sampled token, at
  `positions [S]`; `n_generated [S]`: tokens it has sampled so far (its keys' index).
  Returns (tokens [S, steps] int32, state)."""
  params = compute_params(params)  # upcast once, not in every step (precision.py)
  s = last.shape[0]

  def body(i, carry):
    state, tok, out = carry
    logits, state = llama.decode_step(params, state, tok, positions + i, config=config,
                                      plan=plan, impl=impl)
    n = n_generated + i
    nxt = sample_rows(logits, temperature, top_p, _keys(seed, n),
                      _ban(eos, n, min_tokens, logits.shape[-1]))
    return state, nxt, out.at[:, i].set(nxt)

  carry = (state, last, jnp.zeros((s, steps), jnp.int32))
  # one step runs straight, not as a loop: a loop's carry may copy the whole state per call
  state, _, out = body(0, carry) if steps == 1 else lax.fori_loop(0, steps, body, carry)
  return out, state


def decode_rows_program(params, state, last, positions, n_generated, temperature, top_p, seed,
                        min_tokens, eos, *, config, plan, steps, impl, sliding_groups):
  """`decode_program` over the first `R = last.shape[0]` slots of a paged pool only (the busy
  ones: the engine keeps them first), the pages written in place. Returns (tokens [R, steps],
  state)."""
  sub = paged_pool.take_rows(state, last.shape[0], sliding_groups)
  out, sub = decode_program(params, sub, last, positions, n_generated, temperature, top_p, seed,
                            min_tokens, eos, config=config, plan=plan, steps=steps, impl=impl)
  return out, paged_pool.put_rows(state, sub, sliding_groups)


def move_program(state, src, dst, *, sliding_groups, **_):
  """Slot `src`'s request moves to slot `dst` (`paged_pool.move_row`)."""
  return paged_pool.move_row(state, src, dst, sliding_groups)

"""Llama / Mistral / Gemma 3 / Qwen 2.5 / Qwen 3 decoder as pure functions over a parameter
pytree.

Design: the parameters are a plain dict pytree with one dict per decoder block:

    {"embed": [V, D], "final_norm": [D], "lm_head": [D, V] (absent when tied),
     "layers": [{"attn_norm": [D], "wq": [D, Hq*Dh], "wk": [D, Hkv*Dh], "wv": [D, Hkv*Dh],
                 "wo": [Hq*Dh, D], "mlp_norm": [D], "w_gate": [D, F], "w_up": [D, F],
                 "w_down": [F, D]}, ...]}                       # num_layers entries
    Gemma 3 layers also hold "q_norm", "k_norm" [Dh], "post_attn_norm", "post_mlp_norm" [D];
    Qwen 3 layers "q_norm", "k_norm"; Qwen 2 layers the biases "bq" [Hq*Dh], "bk", "bv" [Hkv*Dh].

Prompt passes (`forward`, `prefill`) stack the layers inside jit and run one `lax.scan` (fast
compiles; the one weight copy is negligible next to a long prompt). The decode step instead
unrolls the layers over the per-layer weights and a per-layer tuple of KV states: XLA then
reads each weight in place and updates each donated cache in place (a scan over stacked
layers would slice, i.e. copy, every layer's weights and cache every step).

Mistral (v0.1's `config.sliding_window`) and Gemma 3 (`ModelConfig.gemma`'s differences, and
hybrid layers whose sliding layers keep a bounded window cache: `window_cache` /
`window_decode`) run the same loop; the KV method runs on the full layers (docs/gemma3.md).
Activations run in the parameter dtype except bf16 on a CPU without native bf16 dots, which
computes in fp32 (`precision.py`); RMSNorm statistics, RoPE angles, softmax and logits are fp32.
Why a pytree and not the NNX module: docs/design.md#models-as-flax-nnx-modules.

Entry points:
  * `forward(params, tokens)` -- plain full-attention logits `[B, T, V]` (no cache).
  * `prompt_pass(...)` -- the prompt pass shared by `prefill` and the evaluation runner;
    `prompt_layers` runs a range of its layers from given hidden states (the serving engine's
    prefill in layer groups: `prefill_layers`, `join_layer_stacks`).
  * `prefill(params, tokens, lengths)` -- last-token logits `[B, V]` and the per-layer KV state
    built by `rocketkv.prefill` for the plan's method.
  * `decode_step(params, cache, tokens, positions)` -- the pure step
    `(params, cache, tokens, positions) -> (logits, cache)` over `rocketkv.decode_step`.
  * `turn_prefill(params, caches, tokens, turn_lengths)` -- a later turn's prompt run densely
    over per-layer caches (multi-turn: `rocketkv.Conversation`, the evaluation harness).
Building blocks, public for other model-level code: `embed`, `qkv`, `attn_residual`,
`mlp_residual`, `unembed`, `window_cache`, `window_decode`, `window_extend`, `layer_reads`,
`state_view`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax
import numpy as np

from rocketkv_jax import layer_scan, methods
from rocketkv_jax.attend import attend_dense_before_append, dense_attention_xla
from rocketkv_jax.cache import KVCache, from_kept
from rocketkv_jax.config import check_num_layers
from rocketkv_jax.decode import decode_step as kv_decode_step
from rocketkv_jax.decode import prefill as kv_prefill
from rocketkv_jax.decode import window_positions
from rocketkv_jax.methods.base import checked_append
from rocketkv_jax.models.attention import blockwise_causal_attention
from rocketkv_jax.models.config import ModelConfig
from rocketkv_jax.models.precision import compute_params
from rocketkv_jax.models.rope import apply_rope
from rocketkv_jax.ops import group_queries, masked_softmax

Params = dict[str, Any]

LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def param_shapes(config: ModelConfig) -> dict[str, Any]:
  """The expected shape of every parameter (same tree as the params; shapes are tuples)."""
  d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
  hq, hkv, dh = config.num_heads, config.num_kv_heads, config.head_dim
  layer = {
      "attn_norm": (d,), "wq": (d, hq * dh), "wk": (d, hkv * dh), "wv": (d, hkv * dh),
      "wo": (hq * dh, d), "mlp_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d),
  }
  if config.qk_norm:
    layer.update(q_norm=(dh,), k_norm=(dh,))
  if config.gemma:
    layer.update(post_attn_norm=(d,), post_mlp_norm=(d,))
  if config.qkv_bias:
    layer.update(bq=(hq * dh,), bk=(hkv * dh,), bv=(hkv * dh,))
  shapes = {"embed": (v, d), "final_norm": (d,),
            "layers": [dict(layer) for _ in range(config.num_layers)]}
  if not config.tie_word_embeddings:
    shapes["lm_head"] = (d, v)
  return shapes


def init_params(config: ModelConfig, seed: int = 0, dtype=jnp.float32) -> Params:
  """Random parameters (normal(0, 0.02), norms = 1) for smoke tests and benchmarks."""
  rng = np.random.default_rng(seed)

  def make(path, shape):
    name = path[-1].key
    if name.endswith("norm"):
      return jnp.ones(shape, dtype)
    return jnp.asarray(rng.normal(0.0, 0.02, shape).astype(np.float32), dtype)

  return jax.tree_util.tree_map_with_path(
      make, param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))


def stack_layers(params: Params) -> Params:
  """The per-layer dicts stacked on a leading layer axis (for `lax.scan`); layers that are
  stacked already (one dict of `[N, ...]` arrays) are returned as they are."""
  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
  return layers


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
  """RMSNorm over the last axis, statistics in fp32 (as Hugging Face). Gemma's x * (1 + w) is
  this with `weight` = 1 + w (how its params are held: `ModelConfig`)."""
  x32 = x.astype(jnp.float32)
  y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight * y.astype(x.dtype)


def embed(params: Params, config: ModelConfig, tokens: jnp.ndarray) -> jnp.ndarray:
  """tokens `[...]` -> embeddings `[..., D]`; Gemma scales them by sqrt(D) in their dtype."""
  x = params["embed"][tokens]
  if config.gemma:
    x = x * jnp.asarray(config.hidden_size ** 0.5, x.dtype)
  return x


def qkv(lp: Params, config: ModelConfig, x: jnp.ndarray, positions: jnp.ndarray,
        q_rows: jnp.ndarray | None = None, layer: int = 0):
  """x `[B, T, D]`, positions `[B, T]` -> post-RoPE q `[B, Hq, T, Dh]`, k, v `[B, Hkv, T, Dh]`.

  With `q_rows` `[B, W]` (indices into T) only those rows get a query: q is `[B, Hq, W, Dh]`.
  `layer` picks the RoPE (a hybrid's sliding layers have their own base). q comes pre-scaled
  by query_scale * sqrt(Dh), so that every attention downstream, which divides by sqrt(Dh),
  applies `config.query_scale` (a no-op when query_pre_attn_scalar = Dh, as in Gemma 3 270M).
  """
  b, t, _ = x.shape
  dh = config.head_dim
  h = rms_norm(x, lp["attn_norm"], config.rms_norm_eps)
  hq, q_pos = h, positions
  if q_rows is not None:
    hq = jnp.take_along_axis(h, q_rows[:, :, None], axis=1)
    q_pos = jnp.take_along_axis(positions, q_rows, axis=1)
  q, k, v = hq @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
  if config.qkv_bias:
    q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
  q = q.reshape(b, hq.shape[1], config.num_heads, dh).transpose(0, 2, 1, 3)
  k = k.reshape(b, t, config.num_kv_heads, dh).transpose(0, 2, 1, 3)
  v = v.reshape(b, t, config.num_kv_heads, dh).transpose(0, 2, 1, 3)
  if config.qk_norm:  # per-head RMSNorm of q and k, before RoPE
    q = rms_norm(q, lp["q_norm"], config.rms_norm_eps)
    k = rms_norm(k, lp["k_norm"], config.rms_norm_eps)
  scale = config.query_scale * dh ** 0.5
  if scale != 1.0:
    q = q * jnp.asarray(scale, q.dtype)
  return apply_rope(q, q_pos, config, layer), apply_rope(k, positions, config, layer), v


def attn_residual(lp: Params, x: jnp.ndarray, attn: jnp.ndarray,
                  config: ModelConfig | None = None) -> jnp.ndarray:
  """x `[B, T, D]` + o_proj(attn `[B, Hq, T, Dh]`) (RMSNorm-ed first on Gemma: `config`)."""
  b, hq, t, dh = attn.shape
  o = attn.astype(x.dtype).transpose(0, 2, 1, 3).reshape(b, t, hq * dh) @ lp["wo"]
  if config is not None and config.gemma:
    o = rms_norm(o, lp["post_attn_norm"], config.rms_norm_eps)
  return x + o


def mlp_residual(lp: Params, config: ModelConfig, x: jnp.ndarray) -> jnp.ndarray:
  """x + SwiGLU(RMSNorm(x)); Gemma: x + RMSNorm(GeGLU(RMSNorm(x))) with tanh-GELU."""
  h = rms_norm(x, lp["mlp_norm"], config.rms_norm_eps)
  if not config.gemma:
    return x + (jax.nn.silu(h @ lp["w_gate"]) * (h @ lp["w_up"])) @ lp["w_down"]
  y = (jax.nn.gelu(h @ lp["w_gate"], approximate=True) * (h @ lp["w_up"])) @ lp["w_down"]
  return x + rms_norm(y, lp["post_mlp_norm"], config.rms_norm_eps)


def unembed(params: Params, config: ModelConfig, x: jnp.ndarray) -> jnp.ndarray:
  """Final norm + LM head: x `[..., D]` -> fp32 logits `[..., V]`."""
  h = rms_norm(x, params["final_norm"], config.rms_norm_eps)
  if config.tie_word_embeddings:
    # contract against embed [V, D] directly: an explicit `.T` is a 4*V*D-byte copy that XLA
    # does not hoist out of the decode while_loop.
    logits = jnp.einsum("...d,vd->...v", h, params["embed"]).astype(jnp.float32)
  else:
    logits = (h @ params["lm_head"]).astype(jnp.float32)
  if config.final_logit_softcap is not None:
    c = float(config.final_logit_softcap)
    logits = c * jnp.tanh(logits / c)
  return logits


def _kind(config: ModelConfig, i: int):
  """What a layer's math depends on besides its weights: layers of one kind share a scan."""
  return None if config.layer_types is None else config.layer_types[i]


def _runs(config: ModelConfig, lo: int, hi: int, alone=()) -> list[tuple[int, int]]:
  """`(a, b)` runs of layers [lo, hi) of one kind; the layers in `alone` stand alone."""
  out, a = [], lo
  while a < hi:
    b = a + 1
    if a not in alone:
      while b < hi and b not in alone and _kind(config, b) == _kind(config, a):
        b += 1
    out.append((a, b))
    a = b
  return out


def forward(params: Params, tokens: jnp.ndarray, *, config: ModelConfig,
            block_size: int = 512) -> jnp.ndarray:
  """Plain full-attention forward: tokens `[B, T]` -> logits `[B, T, V]` (fp32)."""
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  params = compute_params(params)
  x = embed(params, config, tokens)
  layers = stack_layers(params)

  def layer(x, lp, i):
    q, k, v = qkv(lp, config, x, positions, layer=i)
    a = blockwise_causal_attention(
        q, k, v, sliding_window=config.layer_window(i), block_size=block_size)
    x = mlp_residual(lp, config, attn_residual(lp, x, a, config))
    return x, None

  for lo, hi in _runs(config, 0, config.num_layers):  # one scan per run of like layers
    x, _ = lax.scan(functools.partial(layer, i=lo), x, jax.tree.map(lambda a: a[lo:hi], layers))
  return unembed(params, config, x)


def _last_token_attention(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, lengths: jnp.ndarray,
                          sliding_window: int | None) -> jnp.ndarray:
  """Attention of each sequence's last valid token: q `[B, Hq, Dh]` over k, v `[B, Hkv, L, Dh]`
  (keys j < lengths[b], and within the sliding window) -> `[B, Hq, Dh]` in q's dtype: the
  core's dense decode attention with a prompt-length mask."""
  j = jnp.arange(k.shape[2], dtype=jnp.int32)[None, :]
  visible = j < lengths[:, None]  # [B, L]
  if sliding_window is not None:
    visible &= (lengths[:, None] - 1 - j) < sliding_window
  return dense_attention_xla(q, k, v, jnp.broadcast_to(visible[:, None, :], k.shape[:3]))


def prompt_spans(config: ModelConfig, static_layers: tuple[int, ...] = ()):
  """The `(lo, hi)` groups of `prompt_pass`'s `LayerStack`: the scanned runs of like layers of
  0..N-2 between the `static_layers` (alone), then the last layer alone."""
  n = config.num_layers
  static = {i for i in static_layers if 0 <= i < n}
  return tuple(_runs(config, 0, n - 1, alone=static)) + ((n - 1, n),)


def prompt_layers(params: Params, x: jnp.ndarray, lengths: jnp.ndarray, lo: int, hi: int, *,
                  config: ModelConfig, window: int, per_layer, block_size: int = 512,
                  static_layers: tuple[int, ...] = ()):
  """Layers [lo, hi) of `prompt_pass` from the hidden states `x [B, L, D]` entering layer `lo`
  (`embed`'s output for lo = 0; compute dtype): a prompt pass can run in several calls, each
  carrying only `x` to the next (the serving engine's prefill in layer groups).

  Returns (x `[B, L, D]` entering layer `hi`, or for hi = N the final hidden state `[B, D]` at
  each sequence's last valid token; a `LayerStack` of `per_layer`'s results for layers
  [lo, hi): `prompt_spans` cut at lo and hi, a scanned run's part of one layer unstacked).
  `join_layer_stacks` assembles the parts of [0, N) into `prompt_pass`'s stack."""
  b, length = x.shape[:2]
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
  widx = window_positions(lengths, length, window)  # [B, W]; widx[:, -1] = lengths - 1
  kv_dtype = params["embed"].dtype  # K/V reach `per_layer` in the parameter dtype
  params = compute_params(params)
  n = config.num_layers
  if not 0 <= lo < hi <= n:
    raise ValueError(f"layers [lo, hi) must satisfy 0 <= lo < hi <= {n}, got [{lo}, {hi})")
  static = {i for i in static_layers if 0 <= i < n}

  def store(k, v, qw, i):
    return per_layer(k.astype(kv_dtype), v.astype(kv_dtype), qw.astype(kv_dtype), i)

  layers = params["layers"]
  per_layer_params = isinstance(layers, (list, tuple))
  # a layer's weights: its own dict (what the loaders make), or a slice of stacked ones
  layer_params = lambda i: (layers[i] if per_layer_params
                            else jax.tree.map(lambda a: a[i], layers))
  # a scanned run's weights stacked (a copy of them; none when they are stacked already)
  run_params = lambda lo, hi: (jax.tree.map(lambda *xs: jnp.stack(xs), *layers[lo:hi])
                               if per_layer_params else jax.tree.map(lambda a: a[lo:hi], layers))

  def layer(x, lp, i):
    # `i`: the layer (for a scanned run, its first: every layer of a run is of one kind)
    q, k, v = qkv(lp, config, x, positions, layer=i)
    a = blockwise_causal_attention(
        q, k, v, sliding_window=config.layer_window(i), block_size=block_size)
    q_window = jnp.take_along_axis(q, widx[:, None, :, None], axis=2)  # [B, Hq, W, Dh]
    out = store(k, v, q_window, i)
    x = mlp_residual(lp, config, attn_residual(lp, x, a, config))
    return x, out

  groups, spans = [], []  # results of runs of layers [a, b): stacked when scanned
  # runs of scanned layers of one kind, and the static layers one by one
  for a, b in _runs(config, lo, min(hi, n - 1), alone=static):
    if a in static:
      x, out = layer(x, layer_params(a), a)
      groups.append(out)
    else:
      x, run = lax.scan(functools.partial(layer, i=a), x, run_params(a, b))
      groups.append(run if b - a > 1 else jax.tree.map(lambda t: t[0], run))
    spans.append((a, b))
  if hi == n:  # the last layer: its output is needed only at each last valid token
    lp = layer_params(n - 1)
    q_window, k, v = qkv(lp, config, x, positions, q_rows=widx, layer=n - 1)
    groups.append(store(k, v, q_window, n - 1))
    spans.append((n - 1, n))
    a = _last_token_attention(q_window[:, :, -1], k, v, lengths, config.layer_window(n - 1))
    x = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)  # [B, 1, D]
    x = mlp_residual(lp, config, attn_residual(lp, x, a[:, :, None, :], config))[:, 0]
  return x, LayerStack(groups=tuple(groups), spans=tuple(spans))


def join_layer_stacks(parts, spans) -> "LayerStack":
  """One `LayerStack` of `spans` (`prompt_spans`) from `prompt_layers`' stacks of consecutive
  layer ranges covering them: a run's parts are concatenated along the layer axis (a part of
  one layer gets its axis back), so the result is the one-call `prompt_pass`'s stack."""
  pieces = [(s, g) for p in parts for s, g in zip(p.spans, p.groups)]
  groups = []
  for lo, hi in spans:
    mine = [(a, b, g) for (a, b), g in pieces if lo <= a and b <= hi]
    if sum(b - a for a, b, _ in mine) != hi - lo:
      raise ValueError(f"the parts' spans {[s for s, _ in pieces]} do not cover {(lo, hi)}")
    if hi - lo == 1 or len(mine) == 1:
      groups.append(mine[0][2])
      continue
    stacked = [g if b - a > 1 else jax.tree.map(lambda t: t[None], g) for a, b, g in mine]
    groups.append(jax.tree.map(lambda *xs: jnp.concatenate(xs), *stacked))
  return LayerStack(groups=tuple(groups), spans=tuple(spans))


def prompt_pass(params: Params, tokens: jnp.ndarray, lengths: jnp.ndarray, *,
                config: ModelConfig, window: int, per_layer, block_size: int = 512,
                static_layers: tuple[int, ...] = (), stacked: bool = False):
  """The decoder over a right-padded prompt batch, keeping what the KV methods need.

  Every layer computes K/V for all tokens and queries for the last `window` valid tokens, and
  hands them to `per_layer(k [B, Hkv, L, Dh], v, q_window [B, Hq, W, Dh], layer) -> pytree`.
  `layer` is the layer's index for the layers in `static_layers`, which run unrolled (so their
  results may differ in structure: the KV methods' dense layers, a hybrid's sliding layers), and
  for the others, which run in `lax.scan`s between them, one per run of layers of one kind
  (results of one structure), the index of their run's first layer (a layer outside
  `static_layers`, as each of them is).
  Layers 0..N-2 run blockwise causal attention and the MLP over every token; the last layer's
  output is needed only at each sequence's last valid token, so there its attention and MLP
  run on that one row (a 1/N saving of the prompt pass). It is `embed` then `prompt_layers`
  over [0, N).

  Returns:
    (x_last `[B, D]` final hidden state at each sequence's last valid token,
     outs: a tuple with `per_layer`'s result for each of the N layers; with `stacked`, a
     `LayerStack` of them as the scans made them (`prompt_spans`): each scanned run's results
     stacked, the static layers and the last layer alone. Slicing a run's stacked results into
     layers is a copy of them, which a scanned decode loop over the stack does not need.)
  """
  x = embed(compute_params(params), config, tokens)
  last, stack = prompt_layers(params, x, lengths, 0, config.num_layers, config=config,
                              window=window, per_layer=per_layer, block_size=block_size,
                              static_layers=static_layers)
  return last, (stack if stacked else unstack_cache(stack))


def prefill(params: Params, tokens: jnp.ndarray, lengths: jnp.ndarray, *,
            config: ModelConfig, plan, block_size: int = 512, impl: str = "auto",
            stacked: bool = False):
  """Prompt pass that builds the compressed KV cache.

  Args:
    params: parameter pytree.
    tokens: `[B, L]` int32 right-padded prompt ids.
    lengths: `[B]` int32 valid prompt lengths (1 <= lengths <= L).
    config: static `ModelConfig`.
    plan: static `rocketkv.Plan` (chooses the KV method and its budget).
    block_size: static prefill attention tile.
    impl: "auto" | "xla" | "pallas", passed to `rocketkv.prefill`.
    stacked: return the cache as a `LayerStack` for `decode_step`'s scanned layer loop, as the
      prompt pass's scans made it (`prompt_pass`), instead of a tuple.

  Returns:
    (logits `[B, V]` fp32 at each sequence's last valid token,
     cache: a tuple with one `rocketkv.prefill` state per layer (or their `LayerStack`); the
     method's dense layers (`layer=i`, e.g. RocketKV's `skip_layers`) keep every prompt token).
  """
  static, per_layer = _prefill_layers_of(config, plan, lengths, impl)
  last, cache = prompt_pass(
      params, tokens, lengths, config=config, window=plan.window_size, block_size=block_size,
      static_layers=static, stacked=stacked, per_layer=per_layer)
  return unembed(params, config, last), cache


def _prefill_layers_of(config: ModelConfig, plan, lengths: jnp.ndarray, impl: str):
  """`prefill`'s (static layers, per_layer) for `prompt_pass` / `prompt_layers`."""
  check_num_layers(plan, config.num_layers)
  method = methods.get(plan.method)
  # A method whose decode steps read every slot of every layer (full KV) gets each layer's cache
  # as its own buffer, the prompt pass unrolled: over a stacked group, the attention products
  # of a scanned decode step read the layer's K/V through a dynamic slice of the stack, which
  # XLA:CPU copies out at every step (docs/generation.md#models-and-generation).
  static = tuple(range(config.num_layers)) if method.dense else method.dense_layers(plan)
  sliding = config.window_layers  # a hybrid's sliding layers: a bounded cache of their own

  def per_layer(k, v, qw, layer):
    if layer in sliding:
      return window_cache(k, v, lengths, config.sliding_window, plan.max_new_tokens)
    return kv_prefill(k, v, qw, plan, lengths=lengths, impl=impl, layer=layer)

  return tuple(sorted(set(static) | set(sliding))), per_layer


def prefill_spans(config: ModelConfig, plan) -> tuple[tuple[int, int], ...]:
  """The `(lo, hi)` groups of `prefill(..., stacked=True)`'s `LayerStack`."""
  return prompt_spans(config, _prefill_layers_of(config, plan, None, "xla")[0])


def prefill_layers(params: Params, x: jnp.ndarray, lengths: jnp.ndarray, lo: int, hi: int, *,
                   config: ModelConfig, plan, block_size: int = 512, impl: str = "auto"):
  """Layers [lo, hi) of `prefill` (`prompt_layers` with its KV method) from the hidden states
  `x [B, L, D]` entering layer `lo` (`embed`'s for lo = 0).

  Returns (x `[B, L, D]` entering layer `hi`, or for hi = N the logits `[B, V]` at each
  sequence's last valid token; the `LayerStack` part of layers [lo, hi)). The parts of a split
  of [0, N), joined by `join_layer_stacks(parts, prefill_spans(config, plan))`, are
  `prefill(..., stacked=True)`'s cache."""
  static, per_layer = _prefill_layers_of(config, plan, lengths, impl)
  x, part = prompt_layers(params, x, lengths, lo, hi, config=config, window=plan.window_size,
                          per_layer=per_layer, block_size=block_size, static_layers=static)
  return (unembed(params, config, x) if hi == config.num_layers else x), part


def window_cache(k: jnp.ndarray, v: jnp.ndarray, lengths: jnp.ndarray, window: int,
                 max_new_tokens: int) -> KVCache:
  """A sliding layer's decode state: the last `window` valid prompt tokens of k, v
  `[B, Hkv, L, D]` (fewer for a shorter prompt), with room for `max_new_tokens` more: a
  `KVCache` of capacity min(window, L) + max_new_tokens whatever the prompt length, which
  `window_decode` attends to exactly."""
  b, h, length, _ = k.shape
  w = min(window, length)
  start = jnp.maximum(lengths - w, 0)  # [B]
  idx = start[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]  # [B, w], <= L - 1
  take = lambda x: jnp.take_along_axis(x, idx[:, None, :, None], axis=2)
  pos = jnp.broadcast_to(idx[:, None, :], (b, h, w))
  return from_kept(take(k), take(v), pos, jnp.minimum(lengths, w), lengths,
                   w + max_new_tokens, 0)


def window_decode(q: jnp.ndarray, k_new: jnp.ndarray, v_new: jnp.ndarray, cache: KVCache,
                  window: int):
  """One decode step of a sliding layer: exact attention of q `[B, Hq, Dh]` over its
  `window_cache` (keys within `window` of the new token) and the new token; (out, cache)."""
  new = checked_append(q, k_new, v_new, cache)
  return attend_dense_before_append(q, cache, k_new, v_new, sliding_window=window), new


def window_extend(cache: KVCache, k: jnp.ndarray, v: jnp.ndarray, lengths: jnp.ndarray,
                  window: int, max_new_tokens: int) -> KVCache:
  """A sliding layer's state after a later turn's prompt: the last `window` valid tokens of its
  `window_cache` (slots in position order) followed by the turn's `k, v` `[B, Hkv, T, D]`
  (`lengths[b]` valid), with room for `max_new_tokens` more, as `window_cache` makes it."""
  b, h, t, _ = k.shape
  c = cache.capacity
  w = min(window, c + t)
  n = cache.length + lengths  # [B] valid tokens of cache then turn
  src = jnp.maximum(n - w, 0)[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]  # [B, w]
  idx = jnp.where(src < cache.length[:, None], src, c + src - cache.length[:, None])
  idx = jnp.minimum(idx, c + t - 1)  # rows past n: clamped, then masked by from_kept
  turn_pos = cache.seen[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
  take = lambda x: jnp.take_along_axis(x, idx[:, None, :, None], axis=2)
  kk = take(jnp.concatenate([cache.k, k.astype(cache.dtype)], axis=2))
  vv = take(jnp.concatenate([cache.v, v.astype(cache.dtype)], axis=2))
  pos = jnp.concatenate([cache.pos, jnp.broadcast_to(turn_pos[:, None], (b, h, t))], axis=2)
  pos = jnp.take_along_axis(pos, jnp.broadcast_to(idx[:, None], (b, h, w)), axis=2)
  return from_kept(kk, vv, pos, jnp.minimum(n, w), cache.seen + lengths, w + max_new_tokens, 0)


def state_view(plan, config: ModelConfig | None = None):
  """`state -> KVCache` for a layer's decode state: the method's `view`, except for a
  hybrid's sliding layers, whose state is a `KVCache` of their own (`window_cache`)."""
  view = methods.get(plan.method).view
  return lambda state: state if isinstance(state, KVCache) else view(state)


def layer_reads(config: ModelConfig, plan, kept, steps: int) -> list[int]:
  """Per layer, the K/V tokens one decode step attends to once `kept[i]` prompt tokens are
  cached (`Method.layer_reads`), a hybrid's sliding layers at most `sliding_window`."""
  reads = methods.get(plan.method).layer_reads(plan, kept, steps)
  for i in config.window_layers:
    reads[i] = min(kept[i] + steps, config.sliding_window)
  return reads


@struct.dataclass
class LayerStack:
  """The per-layer decode states grouped for `decode_step`'s scanned layer loop.

  `groups[g]` holds layers `spans[g] = (lo, hi)`: stacked on a leading `[hi - lo]` axis for a run
  of layers the method treats alike (run in one `layer_scan.scan_layers`), or one layer's state
  as it is when `hi = lo + 1` (a method's dense layer: a state of another shape). Made by
  `stack_cache`, undone by `unstack_cache`. A stacked group may also hold dense layers whose
  state has the structure of the others (Quest's: it keeps every token at every layer):
  `decode_step` runs them apart, on the group's own stacked buffers.
  """

  groups: tuple
  spans: tuple = struct.field(pytree_node=False)


def layer_spans(num_layers: int, plan, offset: int = 0,
                alone: tuple[int, ...] = ()) -> tuple[tuple[int, int], ...]:
  """`(lo, hi)` runs of the layers `offset .. offset + num_layers - 1` between the method's
  dense layers and the layers in `alone` (a hybrid's sliding layers), which stand alone."""
  dense = set(methods.get(plan.method).dense_layers(plan)) | set(alone)
  spans, lo, end = [], offset, offset + num_layers
  while lo < end:
    hi = lo + 1
    if lo not in dense:
      while hi < end and hi not in dense:
        hi += 1
    spans.append((lo, hi))
    lo = hi
  return tuple(spans)


def stack_cache(cache, plan, alone: tuple[int, ...] = ()) -> LayerStack:
  """The per-layer tuple from `prefill` -> a `LayerStack` (one copy of the cache); `alone`:
  layers that stand alone besides the method's dense ones (`config.window_layers`)."""
  groups = []
  spans = layer_spans(len(cache), plan, alone=alone)
  for lo, hi in spans:
    groups.append(cache[lo] if hi == lo + 1 else
                  jax.tree.map(lambda *xs: jnp.stack(xs), *cache[lo:hi]))
  return LayerStack(groups=tuple(groups), spans=spans)


def unstack_cache(stack: LayerStack) -> tuple:
  """A `LayerStack` -> the per-layer tuple `prefill` makes."""
  out = []
  for (lo, hi), g in zip(stack.spans, stack.groups):
    out += [g] if hi == lo + 1 else [jax.tree.map(lambda a, i=i: a[i], g) for i in range(hi - lo)]
  return tuple(out)


def decode_step(params: Params, cache, tokens: jnp.ndarray, positions: jnp.ndarray, *,
                config: ModelConfig, plan, impl: str = "auto"):
  """The pure decode step `(params, cache, tokens, positions) -> (logits, cache)`.

  Two layer loops, the same numbers: with the tuple of per-layer states from `prefill` the layers
  are unrolled (XLA reads each weight and updates each donated cache in place); with a
  `LayerStack` (`stack_cache`) each run of like layers is one `lax.scan` (`layer_scan`: the
  caches are still written in place), which compiles ~N times fewer ops -- for long-lived decode
  loops, where the one-time stacking of the cache is cheap. Both read each layer's weights in
  place.

  Args:
    params: parameter pytree.
    cache: the tuple of per-layer KV states from `prefill`, or a `LayerStack` of them.
    tokens: `[B]` int32 the token just sampled for each sequence.
    positions: `[B]` int32 its absolute position (lengths[b] + t for the t-th new token).
    impl: "auto" | "xla" | "pallas", passed to `rocketkv.decode_step`.

  Returns:
    (logits `[B, V]` fp32 for the next token, updated cache of the same form).
  """
  n = config.num_layers
  stacked = isinstance(cache, LayerStack)
  layers_given = sum(hi - lo for lo, hi in cache.spans) if stacked else len(cache)
  if layers_given != n:
    raise ValueError(f"cache must hold {n} layer states, got {layers_given}")
  check_num_layers(plan, n)
  params = compute_params(params)  # a no-op when the caller has upcast them (generate does)
  x = embed(params, config, tokens)[:, None, :]  # [B, 1, D]
  pos = positions[:, None]
  view = state_view(plan, config)
  sliding = config.window_layers

  def attention(q, k, v, state, i, window):
    kv_dtype = view(state).dtype                   # the cache's dtype (bf16 weights
    k, v = k.astype(kv_dtype), v.astype(kv_dtype)  # may compute in fp32: precision.py)
    if i in sliding:  # a hybrid's sliding layer: its bounded cache, no KV method
      return window_decode(q[:, :, 0], k, v, state, window)
    return kv_decode_step(q[:, :, 0], k, v, state, plan, layer=i, sliding_window=window,
                          impl=impl)

  pre = lambda lp, x, i: qkv(lp, config, x, pos, layer=i)
  post = lambda lp, x, out: mlp_residual(
      lp, config, attn_residual(lp, x, out[:, :, None, :], config))
  layers = params["layers"]  # one dict per layer (what the loaders make)

  if not stacked:
    # The method decides which layers stay dense (`layer=i`: e.g. Quest's first two).
    new_cache = []
    for i, (lp, state) in enumerate(zip(layers, cache)):  # unrolled: in-place caches
      out, state = attention(*pre(lp, x, i), state, i, config.layer_window(i))
      x = post(lp, x, out)
      new_cache.append(state)
    return unembed(params, config, x[:, 0]), tuple(new_cache)

  groups = []
  dense = set(methods.get(plan.method).dense_layers(plan))
  for (lo, hi), g in zip(cache.spans, cache.groups):
    if hi == lo + 1:
      out, g = attention(*pre(layers[lo], x, lo), g, lo, config.layer_window(lo))
      x = post(layers[lo], x, out)
      groups.append(g)
      continue
    # A stacked group may hold dense layers of the same state structure (Quest's first two in
    # the eval runner's one stack of every layer): each runs as a scan of its own over its entry
    # of the same stacked buffers, the runs between them as one scan each.
    # (a group never holds a hybrid's sliding layer: they stand alone; its layers are of one
    # kind, so one window for all)
    window = config.layer_window(lo)
    for a, b in layer_spans(hi - lo, plan, offset=lo):
      if a in dense:
        def body(x, state, _, a=a):
          out, state = attention(*pre(layers[a], x, a), state, a, window)
          return post(layers[a], x, out), state
      else:
        # The weights stay per layer: each layer's dense math is a branch of a `lax.switch` on
        # the scanned index, reading its weights in place (a dynamic slice of stacked weights
        # is a copy per layer and step on XLA:CPU: docs/generation.md). The KV method's
        # ops, most of a layer's ops, are compiled once. `layer=a`: no dense layer in the run.
        pres = [functools.partial(pre, lp, i=i) for i, lp in enumerate(layers[a:b], a)]
        posts = [functools.partial(post, lp) for lp in layers[a:b]]

        def body(x, state, j, pres=pres, posts=posts, a=a):
          out, state = attention(*lax.switch(j, pres, x), state, a, window)
          return lax.switch(j, posts, x, out), state

      index = None if (a, b) == (lo, hi) else jnp.arange(a - lo, b - lo, dtype=jnp.int32)
      x, g = layer_scan.scan_layers(body, x, g, jnp.arange(b - a, dtype=jnp.int32), index)
    groups.append(g)
  return unembed(params, config, x[:, 0]), cache.replace(groups=tuple(groups))


def _turn_attention(q, ck, cv, cvalid, tk, tv, tvalid, *, window=None, cpos=None, tpos=None):
  """Turn queries over cache slots (all visible where valid) + causal turn keys.

  q `[B, Hq, T, D]`, ck/cv `[B, Hkv, C, D]`, cvalid `[B, Hkv, C]`, tk/tv `[B, Hkv, T, D]`,
  tvalid `[B, T]` -> `[B, Hq, T, D]` (fp32 softmax). With a sliding `window`, a query at
  position p sees only keys at positions > p - window: `cpos` `[B, Hkv, C]` the slots'
  positions, `tpos` `[B, T]` the turn tokens'.
  """
  b, hq, t, d = q.shape
  qg = group_queries(q, ck.shape[1]).astype(jnp.float32)
  scale = 1.0 / np.sqrt(d)
  s_c = jnp.einsum("bhgtd,bhcd->bhgtc", qg, ck.astype(jnp.float32)) * scale
  s_t = jnp.einsum("bhgtd,bhsd->bhgts", qg, tk.astype(jnp.float32)) * scale
  causal = jnp.tril(jnp.ones((t, t), bool))
  ok_t = causal[None, None, None] & tvalid[:, None, None, None, :]
  ok_c = jnp.broadcast_to(cvalid[:, :, None, None, :], s_c.shape)
  if window is not None:
    qp = tpos[:, None, None, :, None]  # [B, 1, 1, T, 1]
    ok_c = ok_c & (qp - cpos[:, :, None, None, :] < window)
    ok_t = ok_t & (qp - tpos[:, None, None, None, :] < window)
  ok = jnp.concatenate([ok_c, jnp.broadcast_to(ok_t, s_t.shape)], axis=-1)
  # The package's one masking rule (ops.masked_softmax): masked -inf, a row with none all 0.
  p = masked_softmax(jnp.concatenate([s_c, s_t], axis=-1), ok)
  vals = jnp.concatenate([cv, tv], axis=2).astype(jnp.float32)
  o = jnp.einsum("bhgts,bhsd->bhgtd", p, vals)
  return o.reshape(b, hq, t, d).astype(q.dtype)


def turn_prefill(params: Params, caches, tokens: jnp.ndarray, turn_lengths: jnp.ndarray, *,
                 config: ModelConfig, window: int, return_logits: bool = False):
  """A later turn's prompt, run densely over per-layer `KVCache`s (multi-turn decoding).

  Every turn token attends to the valid slots of its layer's cache and, causally, to the turn
  tokens before it; on a layer with a sliding window (`config.layer_window`) only to those
  within the window. Positions continue from `caches[0].seen`. A hybrid's sliding layers take
  their window caches (`window_cache`; `window_extend` adds the turn to them).

  Args:
    params: parameter pytree.
    caches: one `rocketkv.KVCache` per layer (a list), all of one capacity except a hybrid's
      sliding layers'.
    tokens: `[B, T]` int32 right-padded turn ids.
    turn_lengths: `[B]` int32 valid turn tokens.
    config: static `ModelConfig`.
    window: static W: queries of the last W valid turn tokens are returned.
    return_logits: static; also return the fp32 logits `[B, V]` at the last valid turn token
      (the first greedy token is their argmax), for teacher-forcing a reference answer.
  Returns:
    (first greedy token `[B]`, k_turn, v_turn `[N, B, Hkv, T, D]`, q_window `[N, B, Hq, W, D]`),
    ready for `rocketkv.extend` or `rocketkv.begin_turn`; with `return_logits`, the logits
    after them.
  """
  b, t = tokens.shape
  seen = caches[0].seen
  positions = seen[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  widx = window_positions(turn_lengths, t, window)
  tvalid = jnp.arange(t)[None, :] < turn_lengths[:, None]
  x = embed(params, config, tokens)
  layers = params["layers"]
  if not isinstance(layers, (list, tuple)):
    layers = [jax.tree.map(lambda a, i=i: a[i], layers) for i in range(len(caches))]
  ks, vs, qws = [], [], []
  for i, (lp, cache) in enumerate(zip(layers, caches)):
    q, k, v = qkv(lp, config, x, positions, layer=i)
    cvalid = jnp.broadcast_to((jnp.arange(cache.capacity) < cache.length[:, None])[:, None, :],
                              cache.pos.shape)
    a = _turn_attention(q, cache.k, cache.v, cvalid, k.astype(cache.k.dtype),
                        v.astype(cache.v.dtype), tvalid, window=config.layer_window(i),
                        cpos=cache.pos, tpos=positions)
    x = mlp_residual(lp, config, attn_residual(lp, x, a, config))
    ks.append(k)
    vs.append(v)
    qws.append(jnp.take_along_axis(q, widx[:, None, :, None], axis=2))
  last = jnp.take_along_axis(x, (turn_lengths - 1)[:, None, None], axis=1)[:, 0]
  logits = unembed(params, config, last)
  first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  out = (first, jnp.stack(ks), jnp.stack(vs), jnp.stack(qws))
  return out + (logits,) if return_logits else out

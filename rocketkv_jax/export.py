"""`jax.export` of a decode step with its Pallas kernels, from any host.

A jitted `decode_step` under `impl="auto"` carries the Triton kernels for CUDA and the Mosaic
kernels for TPU (`_impl`). Exporting it needs two settings a plain `jax.export` lacks:

- CUDA: jax refuses to serialize the Triton custom call (`__gpu$xla.gpu.triton`: no
  compatibility guarantee) unless it is listed in `disabled_checks`. Mosaic's `tpu_custom_call`
  is on jax's stable list.
- TPU: some Mosaic lowering rules ask for the chip generation; on a host without a TPU it comes
  from an abstract mesh whose device is the chip named by `tpu_device_kind`.

    exp = rocketkv.export_decode_step(plan, q, k_new, v_new, state, platforms=("tpu",))
    blob = exp.serialize()           # later, anywhere: jax.export.deserialize(blob).call(...)

`disabled_checks(platforms)` gives the checks for a `jax.export` of any function of yours that
calls the decode step (a whole model's), under `export_function`'s same settings.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Sequence

import jax
from jax import export as jax_export

from rocketkv_jax import _impl
from rocketkv_jax._checks import require
from rocketkv_jax.decode import decode_step

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
TRITON_TARGET = "__gpu$xla.gpu.triton"  # the custom call of Pallas Triton kernels
TPU_DEVICE_KIND = "TPU v5 lite"  # the chip Mosaic lowers for unless told (v5e)


def _check_platforms(platforms) -> tuple[str, ...]:
  require(isinstance(platforms, (tuple, list)) and len(platforms) >= 1
          and all(p in PLATFORMS for p in platforms),
          f"platforms must be a non-empty sequence of {PLATFORMS}, got {platforms!r}")
  return tuple(platforms)


def disabled_checks(platforms: Sequence[str]) -> list[jax_export.DisabledSafetyCheck]:
  """The `jax.export(..., disabled_checks=...)` a decode step's kernels need for `platforms`."""
  platforms = _check_platforms(platforms)
  if "cuda" in platforms:
    return [jax_export.DisabledSafetyCheck.custom_call(TRITON_TARGET)]
  return []


@contextlib.contextmanager
def _lowering_for(platforms: tuple[str, ...], tpu_device_kind: str):
  """Traces for `platforms` (`impl="pallas"` is checked against them), and gives Mosaic the
  chip generation through an abstract mesh when TPU is one of them."""
  with _impl.target_platforms(platforms), contextlib.ExitStack() as stack:
    if "tpu" in platforms:
      from jax._src.mesh import AbstractDevice  # no public constructor in jax 0.10
      device = AbstractDevice(device_kind=tpu_device_kind, num_cores=1, platform="tpu")
      mesh = jax.sharding.AbstractMesh((1,), ("_rocketkv",), abstract_device=device)
      stack.enter_context(jax.sharding.use_abstract_mesh(mesh))
    yield


def export_function(fn: Callable, *args, platforms: Sequence[str] = ("cuda",),
                    tpu_device_kind: str = TPU_DEVICE_KIND, **kwargs) -> jax_export.Exported:
  """`jax.export(jax.jit(fn), platforms=...)(*args, **kwargs)` with the settings the kernels
  need (module doc). `fn`: any function calling the core (a jitted one is used as is); args:
  arrays or `jax.ShapeDtypeStruct` pytrees."""
  platforms = _check_platforms(platforms)
  require(isinstance(tpu_device_kind, str) and tpu_device_kind.startswith("TPU"),
          f"tpu_device_kind must be a TPU device kind like {TPU_DEVICE_KIND!r}, got "
          f"{tpu_device_kind!r}")
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  with _lowering_for(platforms, tpu_device_kind):
    return jax_export.export(jitted, platforms=list(platforms),
                             disabled_checks=disabled_checks(platforms))(*args, **kwargs)


def export_decode_step(plan, q, k_new, v_new, state, *, platforms: Sequence[str] = ("cuda",),
                       impl: str = "auto", layer: int | None = None,
                       sliding_window: int | None = None,
                       tpu_device_kind: str = TPU_DEVICE_KIND) -> jax_export.Exported:
  """`rocketkv.decode_step` for `plan`, jitted and exported for `platforms`, kernels included.

  Args:
    plan: the static plan.
    q: [B, Hq, D]; k_new, v_new: [B, Hkv, 1, D]; state: the method's state (e.g.
      `jax.eval_shape` of `rocketkv.prefill`): arrays or `jax.ShapeDtypeStruct` pytrees.
    platforms: any of `PLATFORMS`; the exported step runs on each. One platform per call when
      it has kernels (cuda, tpu), unless impl="xla": jax 0.10 lowers every branch of a
      platform switch for each listed platform, and a Triton or Mosaic kernel lowers only for
      its own.
    impl: as `decode_step`'s; "pallas" is checked against `platforms`, not this host.
    layer, sliding_window: as `decode_step`'s (static here).
    tpu_device_kind: the TPU generation Mosaic lowers for, e.g. "TPU v5 lite", "TPU v6 lite".
  Returns:
    The `jax.export.Exported` step: `(q, k_new, v_new, state) -> (out, new state)`.
  """
  _impl.check(impl if impl != "pallas" else "xla")  # "pallas": checked against platforms below
  platforms = _check_platforms(platforms)
  require(impl == "xla" or len(platforms) == 1 or not set(platforms) & set(_impl.KERNEL_PLATFORMS),
          f"platforms {platforms} with kernels (cuda, tpu) must be exported one per call "
          f"unless impl='xla': jax lowers every platform's kernels for each listed platform")
  step = jax.jit(functools.partial(decode_step, plan=plan, layer=layer,
                                   sliding_window=sliding_window, impl=impl))
  return export_function(step, q, k_new, v_new, state, platforms=platforms,
                         tpu_device_kind=tpu_device_kind)

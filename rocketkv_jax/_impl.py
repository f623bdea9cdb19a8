"""Chooses the implementation behind each hot-path function: `impl="auto" | "xla" | "pallas" |
"interpret" | "interpret_tpu"`.

The choice is made where the program runs, not where it is traced: `dispatch` wraps the paths
in `jax.lax.platform_dependent`, so one traced function lowers to the Pallas Triton kernels for
CUDA, to the Pallas Mosaic kernels for TPU and to the XLA path elsewhere. A decode step traced
on a CPU host and exported for CUDA or TPU therefore carries that platform's kernels
(`rocketkv.export_decode_step` sets the export's safety checks for them). Per platform:

    impl           cuda             tpu              any other (cpu, rocm)
    auto           Triton kernels   Mosaic kernels   the pure-jnp (XLA) path
    pallas         Triton kernels   Mosaic kernels   ValueError (no kernels there)
    xla            the XLA path     the XLA path     the XLA path
    interpret      the Triton kernels in Pallas interpret mode, on whatever runs them (tests)
    interpret_tpu  the Mosaic kernels in Pallas TPU interpret mode (simulated HBM / VMEM, DMAs,
                   semaphores), on whatever runs them (tests)

A function without a kernel for a platform runs its XLA path there (TPU: stage 1's window
scores; the fused GPU select + attend runs as its two steps). A paged cache (the serving
engine's pool) runs the paged kernels (kernels/paged_*.py) at its stage-2 reads and sparse
attention (a decode step's dense read, full KV's, is the sparse attention kernel over every
slot; `attend(idx=None)` on pages stays XLA), and the fused select + attend as its two steps.

`impl="pallas"` names the compiled kernels, never an interpret mode. Its platform is checked when
the call is traced (`check`, a ValueError): the platforms being exported for inside
`target_platforms(...)` (what `export_decode_step` sets), else this process's default backend.
So `jax.export(..., platforms=["tpu"])` of an `impl="pallas"` step on a CPU host raises: use
`impl="auto"` (same kernels on cuda / tpu) or `export_decode_step`.

Lowering for one platform lowers only that platform's branch: nothing is paid at run time.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Sequence

import jax
from jax import lax

from rocketkv_jax._checks import require

IMPLS = ("auto", "xla", "pallas", "interpret", "interpret_tpu")
KERNEL_PLATFORMS = ("cuda", "tpu")  # platforms with compiled Pallas kernels
# Internal: the compiled TPU kernels, no platform switch. What a TPU branch passes down to a
# chain of dispatched functions (fused_step), so they do not switch again inside it.
TPU = "_tpu"

_TARGET = threading.local()


@contextlib.contextmanager
def target_platforms(platforms: Sequence[str]) -> Iterator[None]:
  """Within the block, functions are traced for `platforms` (e.g. a `jax.export` for them):
  what `impl="pallas"` is checked against instead of the default backend."""
  before, _TARGET.platforms = getattr(_TARGET, "platforms", None), tuple(platforms)
  try:
    yield
  finally:
    _TARGET.platforms = before


def _platforms() -> tuple[str, ...]:
  """The platforms being traced for: `target_platforms`', else the default backend's (a GPU
  backend named cuda or rocm)."""
  target = getattr(_TARGET, "platforms", None)
  if target is not None:
    return target
  backend = jax.default_backend()
  if backend == "gpu":
    from jax.extend import backend as jex_backend
    version = jex_backend.get_backend().platform_version.lower()
    backend = "rocm" if "rocm" in version else "cuda"
  return (backend,)


def check(impl: str) -> None:
  """ValueError unless `impl` is one of `IMPLS`, and for "pallas" unless every platform traced
  for has kernels."""
  require(impl in IMPLS or impl == TPU, f"impl must be one of {IMPLS}, got {impl!r}")
  if impl == "pallas":
    missing = [p for p in _platforms() if p not in KERNEL_PLATFORMS] + [None]
    require(missing[0] is None, f"impl='pallas' needs a platform in {KERNEL_PLATFORMS}, got "
            f"{missing[0]!r} (impl='interpret' or 'interpret_tpu' runs the kernels' interpret "
            f"modes; to export from this host use impl='auto' or rocketkv.export_decode_step)")


# The impls a paged cache (`KVCache.table`) runs: the paged kernels read the pool through its
# page table (kernels/paged_*.py), the GPU and the TPU ones.
PAGED_IMPLS = IMPLS + (TPU,)


def for_pages(impl: str) -> str:
  """`impl` for a paged cache's stage-2 reads and sparse attention, where every impl has its
  paged kernels (a one-line ValueError names the allowed ones otherwise)."""
  check(impl)
  require(impl in PAGED_IMPLS, f"impl must be one of {PAGED_IMPLS} for a paged cache, got "
          f"{impl!r}")
  return impl


def _call(kernel: str | Callable[[bool], object] | None, interpret: bool, args, kwargs):
  if callable(kernel):
    return kernel(interpret)
  from rocketkv_jax import kernels  # imported on first use (Pallas is a heavy import)
  return getattr(kernels, kernel)(*args, interpret=interpret, **kwargs)


def dispatch(impl: str, xla: Callable[[], object], kernel: str | Callable[[bool], object],
             *args, tpu: str | Callable[[bool], object] | None = None, **kwargs):
  """Runs `xla()`, the GPU kernel or the TPU kernel as `impl` asks for the platform being
  lowered for.

  Args:
    impl: one of `IMPLS` (module doc).
    xla: () -> result, the pure-jnp path.
    kernel: the GPU (Triton) kernel: the name of a function in `rocketkv_jax.kernels` (same
      result structure as `xla`), called with `args`, `kwargs` and `interpret`; or a callable
      `interpret -> result` that imports and calls its kernels itself.
    tpu: the TPU (Mosaic) kernel, the same way (a name is called with the same `args` and
      `kwargs`); None: the XLA path on TPU.
  """
  check(impl)
  if impl == "xla":
    return xla()
  if impl == "interpret":
    return _call(kernel, True, args, kwargs)
  if impl in ("interpret_tpu", TPU):
    return xla() if tpu is None else _call(tpu, impl != TPU, args, kwargs)
  branches = {"cuda": lambda: _call(kernel, False, args, kwargs),
              "tpu": xla if tpu is None else (lambda: _call(tpu, False, args, kwargs))}
  if impl == "auto":
    return lax.platform_dependent(**branches, default=xla)
  return lax.platform_dependent(**branches)  # "pallas": no branch for other platforms

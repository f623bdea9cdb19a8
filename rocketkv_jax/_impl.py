"""Chooses the implementation behind each hot-path function: `impl="auto" | "xla" | "pallas"`.

The choice is made where the program runs, not where it is traced: `dispatch` wraps the two
paths in `jax.lax.platform_dependent`, so one traced function lowers to the Pallas (Triton)
kernels for CUDA and to the other path for every other platform. A decode step traced on a CPU
host and exported with `jax.export(..., platforms=["cuda"])` therefore carries the Triton
kernels. Per platform:

    impl      cuda                  any other platform (cpu, rocm, tpu)
    auto      Pallas kernels        the pure-jnp (XLA) path
    pallas    Pallas kernels        the kernels in Pallas interpret mode (how tests check them)
    xla       the XLA path          the XLA path

Lowering for one platform lowers only that platform's branch: nothing is paid at run time.
"""

from __future__ import annotations

from typing import Callable

from jax import lax

from rocketkv_jax._checks import require

IMPLS = ("auto", "xla", "pallas")


def check(impl: str) -> None:
  require(impl in IMPLS, f"impl must be one of {IMPLS}, got {impl!r}")


def dispatch(impl: str, xla: Callable[[], object], kernel: str | Callable[[bool], object],
             *args, **kwargs):
  """Runs `xla()` or the Pallas kernel `kernels.<kernel>(*args, **kwargs, interpret=...)` as
  `impl` asks for the platform being lowered for.

  Args:
    impl: "auto" | "xla" | "pallas".
    xla: () -> result, the pure-jnp path.
    kernel: the name of a function in `rocketkv_jax.kernels` (same result structure as `xla`),
      called with `args`, `kwargs` and `interpret`; or a callable `interpret -> result` that
      imports and calls its kernels itself.
  """
  check(impl)
  if impl == "xla":
    return xla()

  def pallas(interpret: bool):
    if callable(kernel):
      return kernel(interpret)
    from rocketkv_jax import kernels  # imported on first use (Pallas is a heavy import)
    return getattr(kernels, kernel)(*args, interpret=interpret, **kwargs)

  other = xla if impl == "auto" else (lambda: pallas(True))
  return lax.platform_dependent(cuda=lambda: pallas(False), default=other)

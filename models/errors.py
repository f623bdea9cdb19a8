"""`CheckpointError`: a checkpoint that exists but cannot be read as the model it claims to be."""

from __future__ import annotations

import numpy as np


class CheckpointError(ValueError):
  """A corrupt, truncated or inconsistent checkpoint file.

  The message is one line naming the file and what was expected there (a missing file is a
  `FileNotFoundError` instead). Command-line tools print it as `error: ...`.
  """

  def __init__(self, path: str, problem: str):
    self.path = path
    super().__init__(f"{path!r}: {' '.join(str(problem).split())}")


def cause(e: BaseException) -> str:
  """`e` as one line for a CheckpointError's message: its type and the first line of its text."""
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def check_finite(x: np.ndarray, name: str, path: str) -> None:
  """CheckpointError naming the tensor `name` of the file `path` if `x` holds NaN or Inf (a
  corrupt file whose bytes still parse would otherwise load and generate garbage)."""
  if x.dtype.kind not in "biu" and not np.isfinite(x).all():  # bfloat16 is kind "V"
    raise CheckpointError(path, f"expected finite weights, the tensor {name!r} holds NaN or Inf "
                          "(corrupt?)")

"""`MinMax()`: the paper's stage 2. Chunk min/max key bounds score the chunks, the top_k slots
of the best chunks are read exactly.

The query's top-r dims score each chunk of `chunk_size` slots against the chunk's element-wise
key bounds (`select.approx_scores`); every slot takes its chunk's score. The state is the
`KVCache`, whose `append` keeps the bounds current.
"""

from __future__ import annotations

import dataclasses

from rocketkv_jax import fused_step
from rocketkv_jax._checks import require
from rocketkv_jax.attend import attend
from rocketkv_jax.cache import KVCache
from rocketkv_jax.methods.stage2.base import Stage2
from rocketkv_jax.select import approx_select


@dataclasses.dataclass(frozen=True)
class MinMax(Stage2):
  name = "minmax"

  def select(self, q, state, plan, *, sliding_window=None, impl="auto"):
    require(isinstance(state, KVCache),
            f"a stage2={self.name!r} plan needs a KVCache, got a {type(state).__name__}")
    return approx_select(q, state, plan, sliding_window=sliding_window, impl=impl)

  def attend(self, q, state, plan, *, sliding_window=None, impl="auto"):
    # Two kernels on a GPU where the cache allows (fused_step.py); else select, then attend.
    require(isinstance(state, KVCache),
            f"a stage2={self.name!r} plan needs a KVCache, got a {type(state).__name__}")

    def chain(which):
      idx = self.select(q, state, plan, sliding_window=sliding_window, impl=which)
      return attend(q, state, idx, sliding_window=sliding_window, impl=which)

    return fused_step.select_attend(q, state, plan, chain, sliding_window=sliding_window,
                                    impl=impl)

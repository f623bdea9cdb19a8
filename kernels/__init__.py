"""Pallas GPU kernels for the RocketKV hot path (imported as rocketkv_jax.kernels).

Triton-backend Pallas (`jax.experimental.pallas.triton`); every kernel also runs in Pallas
interpret mode (`interpret=True`) on CPU, which is how the tests check them against the XLA
reference path.

- `approx_bounds_scores` / `approx_chunk_scores`: stage-2 approximate chunk scores
  (== select.approx_bounds_scores_xla / approx_chunk_scores_xla).
- `sparse_attention`: flash-decoding over gathered slots (== attend.sparse_attention_xla).
- `window_scores`: stage-1 SnapKV window scores (== evict.window_scores_xla).
- `quant_slot_logits`: `stage2="quant"` per-slot logits from the packed key codes
  (== methods/stage2/quant.slot_logits_xla).

TPU (Pallas Mosaic) kernels, `tpu_*.py`, with the same arguments and results; they run in
Pallas TPU interpret mode (`interpret=True`: simulated HBM / VMEM and DMAs) on CPU, how the
tests check them (design and estimates: docs/tpu.md):

- `tpu_sparse_attention`: DMAs only the selected pages of K / V into VMEM
  (== attend.sparse_attention_xla).
- `tpu_approx_bounds_scores`: stage-2 approximate chunk scores (== approx_bounds_scores_xla).
- `tpu_quant_slot_logits`: `stage2="quant"` per-slot logits from whole blocks of the packed key
  codes, as bf16 MXU products (== methods/stage2/quant.slot_logits_xla).

Paged (the serving engine's pool: pages `[N, Hkv, P, ...]` and a page table `[B, NP]`,
`rocketkv_jax/pages.py`), `paged_*.py`, each with a jnp reference beside it:

- `paged_sparse_attention`: the selected rows gathered from their pages through the table
  (== attend.paged_sparse_attention_xla).
- `paged_approx_bounds_scores`: chunk scores from the summary pages (== select.paged_approx_scores_xla).
- `paged_quant_slot_logits`: code logits from the code pages (== quant.slot_logits_xla, paged).
- TPU, `paged_tpu_*.py`: `tpu_paged_sparse_attention`, `tpu_paged_approx_bounds_scores`,
  `tpu_paged_quant_slot_logits`, the same results with the pool's page as the unit of DMA (the
  page table scalar-prefetched, whole pages copied HBM -> VMEM by async copies).

Status, correctness on a GPU and timings: docs/kernels.md. Block sizes, split counts and warps
are static keyword arguments with untuned defaults; `benchmarks/kernel_bench.py` checks and times
them. fp32 operands use IEEE fp32 (never TF32).
jax 0.11 deprecates the Pallas Triton backend.
"""

from .approx_scores import approx_bounds_scores, approx_chunk_scores
from .paged_approx_scores import paged_approx_bounds_scores
from .paged_quant_scores import paged_quant_slot_logits
from .paged_sparse_attention import paged_sparse_attention
from .paged_tpu_approx_scores import tpu_paged_approx_bounds_scores
from .paged_tpu_quant_scores import tpu_paged_quant_slot_logits
from .paged_tpu_sparse_attention import tpu_paged_sparse_attention
from .quant_scores import quant_slot_logits
from .sparse_attention import sparse_attention
from .tpu_approx_scores import tpu_approx_bounds_scores
from .tpu_quant_scores import tpu_quant_slot_logits
from .tpu_sparse_attention import tpu_sparse_attention
from .window_scores import window_scores

__all__ = ["approx_bounds_scores", "approx_chunk_scores", "paged_approx_bounds_scores",
           "paged_quant_slot_logits", "paged_sparse_attention", "quant_slot_logits",
           "sparse_attention", "tpu_approx_bounds_scores", "tpu_paged_approx_bounds_scores",
           "tpu_paged_quant_slot_logits", "tpu_paged_sparse_attention", "tpu_quant_slot_logits",
           "tpu_sparse_attention", "window_scores"]

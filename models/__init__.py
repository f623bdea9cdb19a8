"""Llama / Mistral / Gemma 3 / Qwen 2.5 / Qwen 3 ports and checkpoint loading (imported as
`rocketkv_jax.models`).

    import rocketkv_jax as rocketkv
    model = rocketkv.models.load(rocketkv.models.smollm2_path())   # or an HF dir / .gguf
    logits = model.logits(ids)                                        # [B, T] -> [B, T, V]

Modules: `config` (ModelConfig), `rope`, `attention` (blockwise causal prefill), `llama`
(the pure network: forward / prefill / decode_step), `hf_loader`, `gguf_loader`, `tokenizer`,
`checkpoint` (orbax), `sharding` (the dp / tp mesh), `distributed` (multi-process start-up),
`api` (load / load_config / resolve / Model / as_model / smollm2_path / gemma3_path), `nnx_model` (the
decoder as a Flax NNX module, `Model.module`, whose `nnx.split` state drives jitted programs).
"""

from rocketkv_jax.models.api import (NAMED, Model, as_model, gemma3_path, load, load_config,
                                     resolve, smollm2_path)
from rocketkv_jax.models.config import ModelConfig, RopeScaling
from rocketkv_jax.models.errors import CheckpointError
from rocketkv_jax.models.tokenizer import Tokenizer

__all__ = ["CheckpointError", "Model", "ModelConfig", "NAMED", "RopeScaling", "Tokenizer",
           "as_model", "gemma3_path", "load", "load_config", "resolve", "smollm2_path"]

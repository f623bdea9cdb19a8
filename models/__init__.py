"""Llama / Mistral Flax ports and checkpoint loading (imported as rocketkv_jax.models)."""

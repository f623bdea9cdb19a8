"""Pallas GPU kernels for the RocketKV hot path (imported as rocketkv_jax.kernels)."""

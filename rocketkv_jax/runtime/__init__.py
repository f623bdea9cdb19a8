"""The runtime: what drives a model with a KV method (above `rocketkv_jax.models`).

`generate` (batched generation), `decode_loop` (the on-device sampling loop), `sampling`
(strategies), `conversation` (multi-turn), `teacher_forced` (scoring continuations). The public
names are re-exported at the top level: `rocketkv.generate`, `rocketkv.Conversation`, ...
"""

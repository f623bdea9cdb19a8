"""An OpenAI-compatible HTTP server over `rocketkv_jax.runtime.engine.Engine` (docs/serving.md).

    python -m rocketkv_jax.serve --model smollm2 --method recommended --budget 256

Modules: `protocol` (request validation), `responses` (OpenAI's response bodies), `metrics`
(Prometheus), `app` (`build_app`: the FastAPI app), `server` (uvicorn with a draining
shutdown), `__main__` (the command line). Needs the `serve` extra.
"""

try:
  import fastapi as _fastapi  # noqa: F401
  import prometheus_client as _prometheus_client  # noqa: F401
  import uvicorn as _uvicorn  # noqa: F401
except ImportError as _e:
  from rocketkv_jax.serve._extra import missing as _missing
  raise _missing(_e) from None

from rocketkv_jax.serve.app import build_app  # noqa: E402
from rocketkv_jax.serve.server import serve  # noqa: E402

__all__ = ["build_app", "serve"]

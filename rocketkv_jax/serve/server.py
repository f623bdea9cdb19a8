"""`serve(app, engine, ...)`: runs the app under uvicorn and drains the engine on exit.

On SIGTERM or Ctrl-C the server stops accepting connections and `/health` answers 503; the
engine admits nothing more (new requests get 503, waiting ones end as aborted), lets the
running ones finish for up to `shutdown_timeout` seconds, then aborts the rest, so every open
response ends (a stream with finish_reason "abort") and the process exits. A second Ctrl-C
exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading

from rocketkv_jax.serve import _extra

try:  # the serve extra
  import uvicorn
except ImportError as e:
  raise _extra.missing(e) from None

from rocketkv_jax.runtime.engine import Engine


class _Server(uvicorn.Server):
  """uvicorn's server, draining the engine before it waits for open connections."""

  def __init__(self, config: uvicorn.Config, engine: Engine, shutdown_timeout: float):
    super().__init__(config)
    self._engine = engine
    self._timeout = shutdown_timeout
    self._drain: threading.Thread | None = None

  async def shutdown(self, sockets=None) -> None:
    self.config.app.state.closing = True
    st = self._engine.stats()
    logging.getLogger("uvicorn.error").info(
        "Draining: %d running requests may finish within %.0f s, %d waiting ones are aborted",
        st.num_running, self._timeout, st.num_waiting)
    self._drain = threading.Thread(target=self._engine.shutdown, args=(self._timeout,),
                                   name="rocketkv-drain", daemon=True)
    self._drain.start()
    await super().shutdown(sockets)
    await asyncio.to_thread(self._drain.join)


def serve(app, engine: Engine, host: str = "127.0.0.1", port: int = 8000,
          shutdown_timeout: float = 10.0, log_level: str = "info") -> None:
  """Serves `app` (from `build_app`, over the started `engine`) until a signal; blocks."""
  config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          timeout_graceful_shutdown=shutdown_timeout + 10.0)
  server = _Server(config, engine, shutdown_timeout)
  # uvicorn re-raises the signal that stopped it once it is done; with this handler in place
  # (restored by uvicorn before it re-raises) a drained server exits normally, status 0.
  previous = {}
  if threading.current_thread() is threading.main_thread():
    previous = {s: signal.signal(s, _drained) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    server.run()
  finally:
    engine.shutdown(0.0)
    for s, handler in previous.items():
      signal.signal(s, handler)


def _drained(sig, frame) -> None:
  """The stopping signal, re-raised after the drain: nothing is left to do."""
  del sig, frame

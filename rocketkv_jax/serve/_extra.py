"""The one error for a missing `serve` extra, raised where its packages are imported."""


def missing(e: ImportError) -> ImportError:
  return ImportError(f"rocketkv_jax.serve needs the serve extra (missing {e.name}): "
                     f"pip install 'rocketkv-jax[serve]'")

"""The jax range in pyproject.toml: one range for the core and the CUDA extras, the installed jax
inside it, and the Pallas Triton backend the GPU kernels lower through present in it
(docs/gpu.md "jax versions")."""

import pathlib
import re

import jax
import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"


def _project():
  return tomllib.loads(PYPROJECT.read_text())["project"]


def _range(spec: str, name: str) -> str:
  m = re.fullmatch(rf"{re.escape(name)}(\[[\w-]+\])?(.*)", spec.strip())
  assert m, spec
  return m.group(2)


def test_one_jax_range_for_core_and_cuda_extras():
  project = _project()
  deps = {d.split(">")[0].split("<")[0].split("[")[0]: d for d in project["dependencies"]}
  core = _range(deps["jax"], "jax")
  assert _range(deps["jaxlib"], "jaxlib") == core == ">=0.10.2,<0.12"
  extras = project["optional-dependencies"]
  assert extras["cuda"] == [f"jax[cuda13]{core}"] and extras["cuda12"] == [f"jax[cuda12]{core}"]


def test_installed_jax_is_in_range_and_has_the_triton_backend():
  version = tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:3])
  assert (0, 10, 2) <= version < (0, 12, 0), jax.__version__
  from jax.experimental.pallas import triton as plgpu  # noqa: F401  (removed in a later jax)
  assert hasattr(plgpu, "CompilerParams")

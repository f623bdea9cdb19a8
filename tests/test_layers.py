"""The package's layers and its freedom from import cycles: the contracts of [tool.importlinter]
in pyproject.toml, checked by import-linter on the installed import tree.

setuptools maps the top-level models/ and kernels/ in as rocketkv_jax.models and
rocketkv_jax.kernels (package-dir), but import-linter's graph builder (grimp) only walks the
directory of rocketkv_jax/. So the test links the installed tree together in a temporary
directory and runs `lint-imports` there; the contract names models and kernels as required
layers, so a tree without them fails too.
"""

import os
import subprocess
import sys

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPROJECT = os.path.join(ROOT, "pyproject.toml")
PACKAGE = "rocketkv_jax"
LINT = ("import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())")


def _tree(dst: str) -> str:
  """Links the import tree of pyproject's package-dir under `dst`: a real directory per mapped
  package, holding links to its files and subpackages. Returns the directory to import from."""
  with open(PYPROJECT, "rb") as f:
    dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
  for pkg, src in dirs.items():
    assert pkg == PACKAGE or pkg.rpartition(".")[0] == PACKAGE, f"unexpected package-dir {pkg}"
    out = os.path.join(dst, *pkg.split("."))
    os.makedirs(out)
    for name in os.listdir(os.path.join(ROOT, src)):
      if name != "__pycache__":
        os.symlink(os.path.join(ROOT, src, name), os.path.join(out, name))
  return dst


def _lint(tree: str) -> subprocess.CompletedProcess:
  """`lint-imports` on pyproject's contracts, importing rocketkv_jax from `tree` (the editable
  install's finder comes after PYTHONPATH)."""
  env = dict(os.environ, PYTHONPATH=tree)
  return subprocess.run([sys.executable, "-c", LINT, PYPROJECT, "--no-cache"], cwd=tree, env=env,
                        capture_output=True, text=True, timeout=600)


def test_layers_and_no_cycles(tmp_path):
  r = _lint(_tree(str(tmp_path)))
  assert r.returncode == 0, f"import-linter:\n{r.stdout}\n{r.stderr}"
  assert "0 broken" in r.stdout, r.stdout


# (module file under the tree, import appended, what the report says)
BREAKS = [
    # a utility importing the core: upward
    ("rocketkv_jax/ops.py", "from rocketkv_jax.cache import KVCache\n",
     "rocketkv_jax.ops is not allowed to import rocketkv_jax.cache"),
    # a kernel importing the core inside a function (a lazy import is still an import)
    ("rocketkv_jax/kernels/window_scores.py",
     "def _probe():\n  from rocketkv_jax.evict import evict\n",
     "rocketkv_jax.kernels is not allowed to import rocketkv_jax.evict"),
    # two modules of one layer importing each other: fused_step imports select
    ("rocketkv_jax/select.py", "def _probe():\n  from rocketkv_jax import fused_step\n",
     "No import cycles between sibling modules or packages BROKEN"),
]


@pytest.mark.parametrize("path, line, report", BREAKS, ids=["upward", "lazy-upward", "cycle"])
def test_an_upward_import_or_a_cycle_breaks_a_contract(tmp_path, path, line, report):
  """The contracts can fail: one added import in a copy of a module breaks them."""
  tree = _tree(str(tmp_path))
  module = os.path.join(tree, path)
  with open(module) as f:
    text = f.read()
  os.remove(module)  # the link only
  with open(module, "w") as f:
    f.write(text + "\n\n" + line)
  r = _lint(tree)
  assert r.returncode != 0 and report in r.stdout, f"import-linter:\n{r.stdout}\n{r.stderr}"

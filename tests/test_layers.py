"""The library's layers: no module imports from a layer above its own.

numerics < contract < kernels < ops < harness < {auditing, training}
< {experiments, testing} < configs < commands. Siblings (auditing and
training; experiments and testing) do not import each other. Every
import counts, at module level, inside functions and under TYPE_CHECKING.
"""

import ast
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = REPO / "stableattn"
# The layer stableattn.configs, kept at the top of the checkout.
CONFIGS = REPO / "configs"
RANK = {
  "numerics": 0,
  "contract": 1,
  "kernels": 2,
  "ops": 3,
  "harness": 4,
  "auditing": 5,
  "training": 5,
  "experiments": 6,
  "testing": 6,
  "configs": 7,
  "commands": 8,
}


def _layer_of(module: str) -> str | None:
  """'stableattn.kernels.reference' -> 'kernels'; None for the top level."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else None


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found += [(node.lineno, alias.name) for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      found.append((node.lineno, node.module or ""))
  return [(line, m) for line, m in found if m.split(".")[0] == "stableattn"]


def _home(path: pathlib.Path) -> str:
  """The layer a module of the library belongs to."""
  if path.is_relative_to(CONFIGS):
    return "configs"
  return path.relative_to(PACKAGE).parts[0]


def upward_imports(path: pathlib.Path) -> list[str]:
  """Each import in `path` that reaches a layer it may not, as a line."""
  own = _home(path)
  tree = ast.parse(path.read_text())
  bad = []
  for line, module in _imported_modules(tree):
    target = _layer_of(module)
    if target is None:
      bad.append(f"{path.name}:{line} imports the top-level package")
    elif target != own and RANK[target] >= RANK[own]:
      bad.append(f"{path.name}:{line} ({own}) imports {module} ({target})")
  return bad


def library_modules():
  layered = [p for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE]
  return sorted([*layered, *CONFIGS.glob("*.py")])


def test_every_module_is_in_a_known_layer():
  layers = {_home(p) for p in library_modules()}
  assert layers == set(RANK), layers ^ set(RANK)
  entry = ("__init__.py", "__main__.py")
  loose = [p.name for p in PACKAGE.glob("*.py") if p.name not in entry]
  assert not loose, f"modules outside every layer: {loose}"


@pytest.mark.parametrize("layer", sorted(RANK))
def test_no_module_imports_from_a_higher_layer(layer):
  bad = []
  for path in library_modules():
    if _home(path) == layer:
      bad += upward_imports(path)
  assert not bad, "\n".join(bad)


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
  fake = tmp_path / "stableattn"
  (fake / "kernels").mkdir(parents=True)
  module = fake / "kernels" / "bad.py"
  module.write_text(
    "def f():\n  from stableattn.ops.dispatch import attention\n"
    "  from stableattn.numerics import rounding\n"
  )
  monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
  assert upward_imports(module) == [
    "bad.py:2 (kernels) imports stableattn.ops.dispatch (ops)"
  ]


MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80  # docstrings excluded


def _function_lengths(tree: ast.AST):
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      first = node.body[0]
      docstring = (
        first.end_lineno - first.lineno + 1
        if isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
        else 0
      )
      yield node, node.end_lineno - node.lineno + 1 - docstring


def oversized(path: pathlib.Path) -> list[str]:
  """The module if it is over MAX_MODULE_LINES, and each function over
  MAX_FUNCTION_LINES, as lines."""
  source = path.read_text()
  found = []
  lines = len(source.splitlines())
  if lines > MAX_MODULE_LINES:
    found.append(f"{path.name}: {lines} lines")
  for node, length in _function_lengths(ast.parse(source)):
    if length > MAX_FUNCTION_LINES:
      found.append(f"{path.name}:{node.lineno} {node.name}: {length} lines")
  return found


def test_modules_and_functions_stay_readable():
  root = PACKAGE.parent
  paths = [
    *PACKAGE.rglob("*.py"),
    *CONFIGS.glob("*.py"),
    *(root / "launch").glob("*.py"),
    *(root / "tests").glob("*.py"),
  ]
  found = [line for path in sorted(paths) for line in oversized(path)]
  assert not found, "\n".join(found)


def test_the_size_check_sees_a_long_function(tmp_path):
  body = "\n".join(f"  x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
  module = tmp_path / "long.py"
  module.write_text(f'def f():\n  """Doc."""\n{body}\n')
  assert oversized(module) == [f"long.py:1 f: {MAX_FUNCTION_LINES + 1} lines"]

"""No function in vcpo_jax/ is longer than MAX_LINES (def line to last line, docstring included), read with `ast`."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_LINES = 120

# "path:function" -> why it is still longer. Empty: every function is within the limit.
ALLOWED: dict[str, str] = {}


def _lengths():
  for path in sorted((ROOT / "vcpo_jax").rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        yield f"{path.relative_to(ROOT)}:{node.name}", node.end_lineno - node.lineno + 1


def test_no_function_over_the_limit():
  long = [f"{name}: {n} lines" for name, n in _lengths() if n > MAX_LINES and name not in ALLOWED]
  assert not long, f"functions over {MAX_LINES} lines (split them into named helpers): {long}"


def test_allowed_entries_are_still_long():
  lengths = dict(_lengths())
  stale = [name for name in ALLOWED if lengths.get(name, 0) <= MAX_LINES]
  assert not stale, f"ALLOWED entries now within {MAX_LINES} lines or gone (remove them): {stale}"

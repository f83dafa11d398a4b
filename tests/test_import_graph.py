"""The package's import graph has floors: every import points down (or within its own unit), and no module loop.

Read from the source with `ast` (nothing is imported), so a new upward arrow or circle fails here before it
becomes an import-order bug. `from pkg import submodule` counts as an arrow to the submodule, as Python resolves it.
"""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "d2f_jax"

# Units (top-level modules and subpackages of d2f_jax) by floor: a unit may import its own floor's
# ground-floor units, and anything on a lower floor.
FLOORS = (
    ("sharding", "usage", "datafiles", "reporting", "datasheets", "config_files", "tasks", "workdir_lock",
     "compilation_cache", "xla_maps"),
    ("kernels",),
    ("models",),
    ("convert",),
    ("decode",),
    ("api",),
    ("serve",),
    ("train",),
    ("evals",),
    ("e2e", "aot"),
    ("bench",),
    ("main", "distill", "evaluate", "generate"),
)
MAX_LINES = 300


def _modules() -> dict[str, pathlib.Path]:
  modules = {}
  for path in PACKAGE.rglob("*.py"):
    parts = ("d2f_jax",) + path.relative_to(PACKAGE).with_suffix("").parts
    modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return modules


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
  """The d2f_jax modules `name` imports, each resolved to the deepest module that exists."""
  targets = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
      else:
        module = node.module or ""
      submodules = [f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in modules]
      found = submodules + ([module] if len(submodules) < len(node.names) else [])
    else:
      continue
    for target in found:
      if not target.startswith("d2f_jax"):
        continue
      while target not in modules and "." in target:
        target = target.rsplit(".", 1)[0]
      if target != name and target != "d2f_jax":  # the root __init__ is lazy (PEP 562), never a real edge
        targets.add(target)
  return targets


def _graph():
  modules = _modules()
  return {name: _imports(name, path, modules) for name, path in modules.items()}


def _unit(module: str) -> str:
  return module.split(".")[1]


def _floor(unit: str) -> int:
  for level, units in enumerate(FLOORS):
    if unit in units:
      return level
  raise AssertionError(f"d2f_jax.{unit} is on no floor of tests/test_import_graph.py FLOORS: place it there")


def test_every_import_points_down():
  upward = []
  for module, targets in _graph().items():
    if module == "d2f_jax":
      continue
    for target in targets:
      source_unit, target_unit = _unit(module), _unit(target)
      if source_unit == target_unit:
        continue
      if _floor(target_unit) >= _floor(source_unit) and _floor(target_unit) != 0:
        upward.append(f"{module} -> {target}")
  assert not upward, "imports that do not point to a lower floor:\n" + "\n".join(sorted(upward))


def test_no_import_circle():
  graph = _graph()
  state: dict[str, int] = {}  # 1 on the current path, 2 finished
  circles = []

  def visit(module, path):
    state[module] = 1
    for target in sorted(graph.get(module, ())):
      if state.get(target) == 1:
        circles.append(" -> ".join(path[path.index(target):] + [target]))
      elif target not in state:
        visit(target, path + [target])
    state[module] = 2

  for module in sorted(graph):
    if module not in state:
      visit(module, [module])
  assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_checker_sees_an_upward_arrow_and_a_circle(tmp_path, monkeypatch):
  """The two checks above can fail: a fake package with models -> decode and a -> b -> a trips both."""
  fake = tmp_path / "d2f_jax"
  (fake / "models").mkdir(parents=True)
  (fake / "decode").mkdir()
  (fake / "__init__.py").write_text("")
  (fake / "models" / "__init__.py").write_text("from d2f_jax.decode import loop\n")
  (fake / "decode" / "__init__.py").write_text("")
  (fake / "decode" / "loop.py").write_text("from . import other\n")
  (fake / "decode" / "other.py").write_text("from d2f_jax.decode import loop\n")
  monkeypatch.setitem(globals(), "PACKAGE", fake)
  graph = _graph()
  assert graph["d2f_jax.models"] == {"d2f_jax.decode.loop"}
  assert graph["d2f_jax.decode.loop"] == {"d2f_jax.decode.other"}
  assert "d2f_jax.models -> d2f_jax.decode.loop" in _failure_of(test_every_import_points_down)
  assert "d2f_jax.decode.loop -> d2f_jax.decode.other -> d2f_jax.decode.loop" in _failure_of(test_no_import_circle)


def _failure_of(check) -> str:
  try:
    check()
  except AssertionError as error:
    return str(error)
  raise AssertionError(f"{check.__name__} passed on a package built to fail it")


def test_files_stay_short():
  long_files = [f"{path.relative_to(PACKAGE.parent)}: {n} lines" for path in PACKAGE.rglob("*.py")
                if (n := len(path.read_text().splitlines())) > MAX_LINES]
  assert not long_files, f"files over {MAX_LINES} lines (split them along a seam):\n" + "\n".join(long_files)


INFERENCE_UNITS = ("decode", "models", "kernels", "convert")


def test_inference_never_imports_training():
  """The floors above already forbid it; stated on its own because it is the rule users rely on: a decode-only
  install path never pulls in the trainer."""
  arrows = sorted(f"{m} -> {t}" for m, targets in _graph().items() if m.count(".") and _unit(m) in INFERENCE_UNITS
                  for t in targets if _unit(t) == "train")
  assert not arrows, "inference modules importing train/:\n" + "\n".join(arrows)


def _private_imports() -> list[str]:
  found = []
  for path in PACKAGE.rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("d2f_jax"):
        found += [f"{path.relative_to(PACKAGE.parent)}: from {node.module} import {a.name}" for a in node.names
                  if a.name.startswith("_") and not a.name.startswith("__")]
  return found


def test_no_private_name_is_imported_across_modules():
  private = _private_imports()
  assert not private, "private names imported from another module (give them a public name):\n" + "\n".join(private)


# Names that must have exactly one definition in the package (imports and re-exports are fine).
DEFINED_ONCE = ("MESH_AXES", "DEFAULT_RULES", "make_mesh", "parse_mesh", "normalize_rules", "logical_spec",
                "MeshLayout", "layout_from_rules")


def _definitions() -> dict[str, list[str]]:
  where: dict[str, list[str]] = {name: [] for name in DEFINED_ONCE}
  for path in PACKAGE.rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        names = [node.name]
      elif isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = [t.id for t in targets if isinstance(t, ast.Name)]
      else:
        continue
      for name in names:
        if name in where:
          where[name].append(str(path.relative_to(PACKAGE.parent)))
  return where


def test_mesh_rules_and_mesh_building_are_defined_once():
  where = _definitions()
  wrong = {name: paths for name, paths in where.items() if len(paths) != 1}
  assert not wrong, f"defined other than once: {wrong}"
  assert all(paths[0].startswith("d2f_jax/sharding/") for paths in where.values()), where


def test_the_private_import_and_definition_checks_can_fail(tmp_path, monkeypatch):
  fake = tmp_path / "d2f_jax"
  (fake / "sharding").mkdir(parents=True)
  (fake / "decode").mkdir()
  (fake / "sharding" / "rules.py").write_text("DEFAULT_RULES = ()\nMESH_AXES = ()\n")
  (fake / "decode" / "mesh.py").write_text("from d2f_jax.sharding.rules import _helper\nDEFAULT_RULES = ()\n"
                                           "def make_mesh(): pass\n")
  monkeypatch.setitem(globals(), "PACKAGE", fake)
  assert _private_imports() == ["d2f_jax/decode/mesh.py: from d2f_jax.sharding.rules import _helper"]
  where = _definitions()
  assert sorted(where["DEFAULT_RULES"]) == ["d2f_jax/decode/mesh.py", "d2f_jax/sharding/rules.py"]
  assert "DEFAULT_RULES" in _failure_of(test_mesh_rules_and_mesh_building_are_defined_once)


# Sibling modules sharing a `prefix_` act as a folder without being one: four or more of them (runner.py plus
# runner_*.py counts the bare runner.py too) are a folder in waiting, to become a subpackage whose __init__.py is
# the public face (d2f_jax/evals/sandbox/, d2f_jax/convert/safetensors/).
FAMILY_SIZE = 4
PENDING_FAMILIES: set[str] = set()  # families allowed to wait (none: decode/runner and bench/cost moved)


def _families() -> dict[str, list[str]]:
  """'dir/prefix' (the package's path below d2f_jax, '/'-joined) -> its modules, for every family of
  FAMILY_SIZE or more; a family inside a larger one (window_attention_* inside window_*) is named once, by the
  shorter prefix."""
  found = {}
  for directory in sorted({path.parent for path in PACKAGE.rglob("*.py")}):
    stems = sorted(path.stem for path in directory.glob("*.py") if path.stem != "__init__")
    prefixes = sorted({"_".join(s.split("_")[:i]) for s in stems for i in range(1, s.count("_") + 1)}, key=len)
    named: list[str] = []
    for prefix in prefixes:
      members = [s for s in stems if s == prefix or s.startswith(prefix + "_")]
      if len(members) >= FAMILY_SIZE and not any(prefix.startswith(p + "_") for p in named):
        named.append(prefix)
        where = directory.relative_to(PACKAGE).as_posix()
        found[prefix if where == "." else f"{where}/{prefix}"] = [f"{s}.py" for s in members]
  return found


def test_no_family_of_sibling_modules_is_a_folder_in_waiting():
  waiting = {key: members for key, members in _families().items() if key not in PENDING_FAMILIES}
  assert not waiting, (f"{FAMILY_SIZE} or more sibling modules sharing a prefix are a folder in waiting: make each a "
                       "subpackage (d2f_jax/<dir>/<prefix>/ with an __init__.py as its public face):\n"
                       + "\n".join(f"d2f_jax/{key}: {', '.join(members)}" for key, members in sorted(waiting.items())))


def test_the_family_check_can_fail(tmp_path, monkeypatch):
  fake = tmp_path / "d2f_jax"
  (fake / "decode").mkdir(parents=True)
  (fake / "evals").mkdir()
  for name in ("__init__", "runner", "runner_a", "runner_b", "runner_c", "loop"):
    (fake / "decode" / f"{name}.py").write_text("")
  for name in ("box_a", "box_b", "box_c", "box_d_e", "boxes", "lm_eval_a", "lm_eval_b", "lm_eval_c"):
    (fake / "evals" / f"{name}.py").write_text("")
  monkeypatch.setitem(globals(), "PACKAGE", fake)
  monkeypatch.setitem(globals(), "PENDING_FAMILIES", {"decode/runner"})
  assert _families() == {"decode/runner": ["runner.py", "runner_a.py", "runner_b.py", "runner_c.py"],
                         "evals/box": ["box_a.py", "box_b.py", "box_c.py", "box_d_e.py"]}
  failure = _failure_of(test_no_family_of_sibling_modules_is_a_folder_in_waiting)
  assert "folder in waiting" in failure and "d2f_jax/evals/box: box_a.py" in failure
  assert "decode/runner" not in failure  # PENDING_FAMILIES

"""The package's layers (docs/architecture.md), checked from the source: imports point down only, the pure layers
import no TensorFlow or Keras, directly or indirectly, and TensorFlow's private API is used in the TensorFlow layer
only."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "capuchin_tf"

# Lowest first. A module may import modules of its own layer and of the layers below it.
LAYERS = ["core", "policy", "tf", "runtime", "frontend", "cli"]
PURE = {"core", "policy"}
# Top-level modules: the version is below everything; the public API (`capuchin_tf`, `_tf_api`) re-exports the
# front ends; `__main__` is the command line.
TOP_LEVEL = {"_version": "core", "__init__": "frontend", "_tf_api": "frontend", "__main__": "cli"}
PRIVATE_TF = ("tensorflow.python", "tensorflow.core", "tensorflow.tsl", "keras.src")
# Private attributes of TensorFlow and Keras objects this project uses (in the tf layer only).
PRIVATE_ATTRIBUTES = frozenset({"__internal__", "_jit_compile", "_flatten_layers", "_seed_generators", "_initialize",
                                "_initialize_with_initializer", "function_call_options", "_call_flat"})


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        yield ".".join(("capuchin_tf", *rel.parts)).removesuffix(".__init__"), path


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return TOP_LEVEL["__init__"]
    return parts[1] if parts[1] in LAYERS else TOP_LEVEL[parts[1]]


def _is_module(name: str) -> bool:
    path = PACKAGE.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or path.is_dir()


def _imports(path: pathlib.Path, module: str) -> list[str]:
    """Every module an `import` or `from ... import` names, at any depth (inside functions too)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append(base)
            found += [f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}")]
    return found


def test_every_module_belongs_to_a_layer():
    for module, _ in _modules():
        assert _layer(module) in LAYERS, module


def test_imports_point_down_only():
    wrong = []
    for module, path in _modules():
        mine = LAYERS.index(_layer(module))
        for name in _imports(path, module):
            if name.split(".")[0] == "capuchin_tf" and name != "capuchin_tf" and LAYERS.index(_layer(name)) > mine:
                wrong.append(f"{module} ({_layer(module)}) imports {name} ({_layer(name)})")
    assert not wrong, "\n".join(wrong)


def test_pure_layers_name_no_tensorflow_or_keras():
    wrong = []
    for module, path in _modules():
        if _layer(module) in PURE:
            wrong += [f"{module} imports {n}" for n in _imports(path, module)
                      if n.split(".")[0] in ("tensorflow", "keras")]
    assert not wrong, "\n".join(wrong)


def test_private_tensorflow_api_is_used_in_the_tensorflow_layer_only():
    wrong = []
    for module, path in _modules():
        if _layer(module) != "tf":
            wrong += [f"{module} imports {n}" for n in _imports(path, module) if n.startswith(PRIVATE_TF)]
    assert not wrong, "\n".join(wrong)


def _private_attributes(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [f"{path}:{n.lineno}: .{n.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in PRIVATE_ATTRIBUTES]


def test_private_attributes_of_tensorflow_and_keras_are_used_in_the_tensorflow_layer_only():
    wrong = []
    for module, path in _modules():
        if _layer(module) != "tf":
            wrong += _private_attributes(path)
    assert not wrong, "\n".join(wrong)


def test_the_checks_can_fail(tmp_path):
    """A core module that imports the runtime and TensorFlow's private API is seen doing so."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f(fn):\n    from capuchin_tf.runtime import managed_step\n"
                   "    from tensorflow.python.ops import x\n    return fn._jit_compile\n")
    names = _imports(bad, "capuchin_tf.core.bad")
    assert "capuchin_tf.runtime.managed_step" in names and "tensorflow.python.ops" in names
    assert [w.rsplit(": ", 1)[1] for w in _private_attributes(bad)] == ["._jit_compile"]
    assert LAYERS.index(_layer("capuchin_tf.runtime.managed_step")) > LAYERS.index(_layer("capuchin_tf.core.bad"))


def test_pure_layers_import_and_plan_with_tensorflow_blocked():
    pure = [m for m, _ in _modules() if _layer(m) in PURE] + ["capuchin_tf.cli.main", "capuchin_tf.cli.plan"]
    code = (
        "import sys; sys.modules['tensorflow'] = None; sys.modules['keras'] = None\n"
        f"import importlib; [importlib.import_module(m) for m in {pure!r}]\n"
        "from capuchin_tf.policy import make_plan\n"
        "from capuchin_tf.core import synthetic\n"
        "t = synthetic.linear_chain(3)\n"
        "p = make_plan(t, synthetic.budget_fraction(t, 0.5), 'capuchin')\n"
        "assert not {'tensorflow', 'keras'} & {m.split('.')[0] for m in sys.modules if sys.modules[m] is not None}\n"
        "print('ok', p.feasible)\n"
    )
    env = dict(os.environ, CAPUCHIN_TF_PURE="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok")

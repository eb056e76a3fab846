"""The package's layers: a module imports only from its own layer or those below it.

The layers are `docs/design.md`'s table ("The packages"); imports inside
functions and under ``TYPE_CHECKING`` count too.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "sklearn_casgd"

# The top-level name under sklearn_casgd -> its layer (higher imports lower).
LAYERS = {
    "_glm": 0,
    "_data": 0,
    "_version": 0,
    "_sklearn_compat": 0,
    "_accel": 1,
    "_engine": 2,
    "_distributed": 3,
    "_estimators": 4,
    "_registry": 5,
    "datasets": 5,
    "metrics": 5,
    "plotting": 5,
    "onnx": 5,
    "__init__": 5,
}


def _module_name(path: Path, root: Path = PACKAGE) -> list[str]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts


def _imported(path: Path, root: Path = PACKAGE) -> set[str]:
    """The top-level names under sklearn_casgd that this module imports."""
    own = _module_name(path, root)
    package = own if path.name == "__init__.py" else own[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = [*base, *(node.module.split(".") if node.module else [])]
                if not target:  # `from . import x` in the top package
                    target = [node.names[0].name]
                names.add(target[0])
            elif node.module and node.module.startswith("sklearn_casgd."):
                names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("sklearn_casgd."):
                    names.add(alias.name.split(".")[1])
    return names


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_top_level_name_has_a_layer():
    assert {_module_name(path)[0] for path in MODULES} == set(LAYERS)


@pytest.mark.parametrize("path", MODULES, ids=lambda path: str(path.relative_to(PACKAGE)))
def test_no_module_imports_from_a_higher_layer(path):
    layer = LAYERS[_module_name(path)[0]]
    higher = {name for name in _imported(path) if LAYERS[name] > layer}
    assert not higher, f"{path.relative_to(PACKAGE)} (layer {layer}) imports {higher}"


def test_the_check_sees_imports_from_above_relative_absolute_and_in_functions(tmp_path):
    root = tmp_path / "sklearn_casgd"
    (root / "_engine").mkdir(parents=True)
    module = root / "_engine" / "upward.py"
    module.write_text(
        "from . import state\n"
        "from .._distributed.launch import WorkerPool\n"
        "def later():\n"
        "    from ..datasets import make_glm_data\n"
        "    import sklearn_casgd._estimators._base\n"
    )
    assert _imported(module, root) == {"_engine", "_distributed", "datasets", "_estimators"}

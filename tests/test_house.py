"""The house rules of punica_hf's own code, checked on its source (contract 1 of the project):

outside the boundary modules ``serving/transformers_cb.py`` (transformers' private API) and ``torch_compat.py``
(torch's private API) no code in punica_hf may
(a) assign ``__class__``;
(b) read or write an attribute ``x._name`` (one leading underscore) unless punica_hf itself defines ``_name``;
(c) import from a module path with a private component (``torch._dynamo``) or from transformers' continuous
    batching package;
and punica_hf's modules import one another without cycles. Each failure lists every offending file:line.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "punica_hf"
BOUNDARY_MODULES = {"serving/transformers_cb.py", "torch_compat.py"}  # relative to PACKAGE
FORBIDDEN_PACKAGES = ("transformers.generation.continuous_batching",)


def _is_private(name: str) -> bool:
    """One leading underscore, not a dunder (``_store``, ``_dynamo``; not ``__class__``, ``__future__``)."""
    return name.startswith("_") and not name.startswith("__")


def _sources() -> dict[str, ast.Module]:
    """Every module of punica_hf, parsed, by its path relative to the package."""
    return {path.relative_to(PACKAGE).as_posix(): ast.parse(path.read_text(), str(path))
            for path in sorted(PACKAGE.rglob("*.py"))}


SOURCES = _sources()


def _module_name(relative: str) -> str:
    parts = ["punica_hf", *relative[: -len(".py")].split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(relative: str) -> bool:
    return relative.endswith("__init__.py")


def _checked() -> Iterator[tuple[str, ast.Module]]:
    """The modules the rules apply to: all but the boundary modules."""
    return ((relative, tree) for relative, tree in SOURCES.items() if relative not in BOUNDARY_MODULES)


def _report(violations: list[str], rule: str) -> str:
    def place(violation: str) -> tuple[str, int]:  # "punica_hf/x.py:12 ..." in file and line order
        path, _, rest = violation.partition(":")
        return path, int(rest.split()[0]) if rest.split()[0].isdigit() else 0

    listed = sorted(violations, key=place)
    return f"{len(violations)} place(s) break the rule that {rule}:\n  " + "\n  ".join(listed)


def _defined_names() -> set[str]:
    """Every name punica_hf defines: functions, classes, assigned names, ``self.`` / ``cls.`` attribute targets,
    ``__slots__`` entries and annotated names (dataclass fields). Import aliases do not count: ``import
    torch._dynamo as _dynamo`` must not make ``torch._dynamo`` ours."""
    names = set()
    for tree in SOURCES.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del))
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)  # our own objects' attributes; `config._attn_implementation = x` is no definition
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
            ):
                names.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)
                             and isinstance(c.value, str))
    return names


def _absolute(relative: str, node: ast.ImportFrom) -> str:
    """The absolute module path of a ``from ... import`` in the module at ``relative``."""
    if not node.level:
        return node.module or ""
    package = _module_name(relative).split(".")
    if not _is_package(relative):
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imported_paths(relative: str, tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, dotted path) of everything a module imports; ``from a.b import c`` gives ``a.b.c``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(relative, node)
            for alias in node.names:
                yield node.lineno, module if alias.name == "*" else f"{module}.{alias.name}"


def test_no_class_switching_outside_the_boundary_modules():
    violations = [
        f"punica_hf/{relative}:{node.lineno}"
        for relative, tree in _checked()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "__class__" and isinstance(node.ctx, ast.Store)
    ]
    assert not violations, _report(violations, f"only {sorted(BOUNDARY_MODULES)} may assign __class__")


def test_no_private_attributes_of_other_packages():
    defined = _defined_names()
    violations = [
        f"punica_hf/{relative}:{node.lineno} .{node.attr}"
        for relative, tree in _checked()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in defined
    ]
    assert not violations, _report(
        violations, f"no code outside {sorted(BOUNDARY_MODULES)} reads or writes another package's private "
        f"attribute (a `._name` that punica_hf does not define)")


def test_no_imports_of_private_modules_or_continuous_batching():
    violations = []
    for relative, tree in _checked():
        for line, path in _imported_paths(relative, tree):
            if path.startswith("punica_hf."):
                continue  # our own modules: the cycle test below checks those
            if any(_is_private(part) for part in path.split(".")) or path.startswith(FORBIDDEN_PACKAGES):
                violations.append(f"punica_hf/{relative}:{line} {path}")
    assert not violations, _report(
        violations, f"no code outside {sorted(BOUNDARY_MODULES)} imports a private module or name of another "
        f"package, or from {FORBIDDEN_PACKAGES[0]}")


def _import_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    """punica_hf's modules, each with the punica_hf modules it imports (and the line of each import)."""
    modules = {_module_name(relative): relative for relative in SOURCES}
    edges: dict[str, set[str]] = {name: set() for name in modules}
    lines: dict[tuple[str, str], int] = {}
    for name, relative in modules.items():
        for line, path in _imported_paths(relative, SOURCES[relative]):
            # "from pkg import name": the submodule pkg.name if there is one, else the package (or module) pkg
            target = path if path in modules else path.rpartition(".")[0]
            if target in modules and target != name:
                edges[name].add(target)
                lines.setdefault((name, target), line)
    return edges, lines


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return components


def test_no_import_cycles_inside_the_package():
    edges, lines = _import_graph()
    violations = []
    for component in _cycles(edges):
        members = set(component)
        arrows = [f"{source} -> {target} (punica_hf/{_relative(source)}:{lines[source, target]})"
                  for source in component for target in sorted(edges[source] & members)]
        violations.append("cycle: " + "; ".join(arrows))
    assert not violations, _report(violations, "punica_hf's modules import one another without cycles")


def _relative(module: str) -> str:
    return next(relative for relative in SOURCES if _module_name(relative) == module)


def test_the_cycle_finder_finds_cycles_and_only_cycles():
    """The checks above are only as good as their parts: a cycle of three, a chain and a relative import."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    node = ast.parse("from ..store import AdapterStore").body[0]
    assert _absolute("serving/engine.py", node) == "punica_hf.store"
    node = ast.parse("from .engine import Engine").body[0]
    assert _absolute("serving/__init__.py", node) == "punica_hf.serving.engine"


@pytest.mark.parametrize("version, outcome", [
    ("5.16.2", ImportError), ("4.57.0", ImportError),
    ("5.26.0", RuntimeWarning), ("5.26.0.dev0", RuntimeWarning), ("6.1.0", RuntimeWarning),
    ("5.17.0", None), ("5.17.0rc1", None), ("5.25.3", None),
])
def test_the_transformers_version_is_checked_against_the_tested_range(monkeypatch, version, outcome):
    transformers = pytest.importorskip("transformers")
    from punica_hf.serving import transformers_cb

    monkeypatch.setattr(transformers, "__version__", version)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if outcome is ImportError:
            with pytest.raises(ImportError, match=r"pip install 'transformers>=5\.17,<5\.26'"):
                transformers_cb.check_transformers_version()
        else:
            transformers_cb.check_transformers_version()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if outcome is RuntimeWarning:
        assert len(messages) == 1 and version in messages[0] and ">=5.17,<5.26" in messages[0], messages
    else:
        assert not messages, messages


def test_the_engines_tested_range_is_the_pin_in_pyproject():
    """One range: the version check warns exactly outside what pip may install."""
    from punica_hf.serving import transformers_cb

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    pins = re.findall(r'"transformers([<>=!~][^"]*)"', pyproject)
    assert pins == [transformers_cb.TESTED_TRANSFORMERS]


def test_importing_the_package_and_its_command_line_loads_neither_peft_nor_bitsandbytes():
    """peft takes seconds to import and brings bitsandbytes, which prints to stderr on machines without its kernels:
    only reading a PEFT config imports it (a module-level import of a peft constant once broke the command line's
    one-line errors)."""
    import subprocess
    import sys

    code = ("import sys, punica_hf, punica_hf.cli, punica_hf.serving\n"
            "print(sorted({'peft', 'bitsandbytes'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).parents[1])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"

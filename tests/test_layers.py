"""The package is layered (docs/layers.md): every module imports only modules of lower layers or of
its own layer, read from the source (imports inside functions included), so a module that reaches
up fails here before anyone runs it. The checker is shown to fail on a planted package."""
import ast
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "mla_cupy"
LAYERS_DOC = ROOT / "docs" / "layers.md"

Layers = Dict[str, Tuple[int, str]]  # module -> (level, layer)


def read_layers(text: str) -> Layers:
    """The table of docs/layers.md: its rows ``| level | layer | `mod`, ... | ... |``."""
    layers: Layers = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].isdigit():
            continue
        for mod in re.findall(r"`([^`]+)`", cells[2]):
            if mod in layers:
                raise ValueError(f"{mod} is in two layers")
            layers[mod] = (int(cells[0]), cells[1])
    return layers


def _module_name(path: Path, pkg_dir: Path, package: str) -> str:
    """``api``, ``distributed.attention``; the package's own ``__init__`` is ``package``."""
    parts = list(path.relative_to(pkg_dir).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) if parts else package


def import_graph(pkg_dir: Path, package: str) -> Dict[str, Set[str]]:
    """Each module of the package (named as in :func:`_module_name`) -> the package's modules it
    imports anywhere in its code. ``from X import name`` counts as an import of ``X.name`` when
    that is a module of the package, else of ``X``; parent packages imported on the way do not
    count."""
    files = {_module_name(p, pkg_dir, package): p for p in pkg_dir.rglob("*.py")}

    def as_module(dotted: str):  # "mla_cupy.distributed.attention" -> "distributed.attention"
        if dotted == package:
            return package
        if dotted.startswith(package + "."):
            name = dotted[len(package) + 1:]
            return name if name in files else None
        return None

    graph: Dict[str, Set[str]] = {}
    for mod, path in files.items():
        here = [package] + ([] if mod == package else mod.split("."))
        if path.name != "__init__.py":
            here = here[:-1]  # the package a plain module lives in
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps.update(filter(None, (as_module(a.name) for a in node.names)))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for a in node.names:
                    target = as_module(f"{base}.{a.name}") or as_module(base)
                    if target:
                        deps.add(target)
        deps.discard(mod)
        graph[mod] = deps
    return graph


def violations(graph: Dict[str, Set[str]], layers: Layers) -> List[str]:
    """What breaks the layering: imports of a higher level or of a sibling layer, modules missing
    from the table, names in the table that are not modules."""
    found = [f"{m}: not in any layer" for m in sorted(set(graph) - set(layers))]
    found += [f"{m}: in the table but not a module" for m in sorted(set(layers) - set(graph))]
    for mod in sorted(set(graph) & set(layers)):
        level, layer = layers[mod]
        for dep in sorted(graph[mod] & set(layers)):
            dep_level, dep_layer = layers[dep]
            if dep_level > level or (dep_level == level and dep_layer != layer):
                found.append(f"{mod} ({layer}, level {level}) imports {dep} ({dep_layer}, level {dep_level})")
    return found


def test_the_package_is_layered():
    layers = read_layers(LAYERS_DOC.read_text(encoding="utf-8"))
    assert len({layer for _, layer in layers.values()}) >= 7
    assert violations(import_graph(ROOT / PACKAGE, PACKAGE), layers) == []


def test_the_graph_sees_every_kind_of_import():
    """Relative imports at any depth, absolute ones, ``from . import module``, imports inside
    functions, and the package's own ``__init__``."""
    graph = import_graph(ROOT / PACKAGE, PACKAGE)
    assert {"reference", "api"} <= graph["distributed.attention"]   # from .. import reference; from ..api import
    assert "jit" in graph["cli"] and PACKAGE in graph["cli"]        # inside functions: from mla_cupy import jit
    assert {"_plan_cache", "merge"} <= graph["torch_ops"]            # from . import _plan_cache; merge in a function
    assert "prefill_plan" in graph[PACKAGE] and "attention" not in graph["distributed"]


@pytest.fixture
def planted(tmp_path):
    """A small package whose base module imports an entry point inside a function, and whose
    plan imports its sibling, the reference."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .api import call\n")
    (pkg / "base.py").write_text("def f():\n    from .api import call\n    return call\n")
    (pkg / "api.py").write_text("from . import base\nfrom .sub import plan\n\ndef call():\n    return plan\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "plan.py").write_text("from ..base import f\nfrom .. import reference\n")
    (pkg / "reference.py").write_text("import pkg.base\n")
    table = ("| level | layer | modules |\n| --- | --- | --- |\n| 0 | base | `base` |\n"
             "| 1 | plan | `sub`, `sub.plan` |\n| 1 | reference | `reference` |\n| 2 | entry | `api` |\n"
             "| 3 | package | `pkg` |\n")
    return pkg, read_layers(table)


def test_the_check_fails_on_a_planted_violation(planted):
    pkg, layers = planted
    graph = import_graph(pkg, "pkg")
    assert graph == {"pkg": {"api"}, "base": {"api"}, "api": {"base", "sub.plan"}, "sub": set(),
                     "sub.plan": {"base", "reference"}, "reference": {"base"}}
    assert violations(graph, layers) == [
        "base (base, level 0) imports api (entry, level 2)",
        "sub.plan (plan, level 1) imports reference (reference, level 1)",
    ]
    del layers["reference"]
    layers["gone"] = (0, "base")
    assert violations(graph, layers)[:2] == ["reference: not in any layer", "gone: in the table but not a module"]

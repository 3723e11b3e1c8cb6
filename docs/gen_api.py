"""Write docs/api.md, the API reference, from the docstrings of the public names.

Usage (from the repository root; no GPU, no torch needed)::

    python docs/gen_api.py            # rewrites docs/api.md
    python docs/gen_api.py --check    # exit 1 if docs/api.md is not what the docstrings give

``tests/test_docs.py`` runs the check, so a docstring changed without the page fails the tests.
The pages cover ``mla_cupy`` (its ``__all__``), ``mla_cupy.reference``, ``mla_cupy.quant`` and
``mla_cupy.fp8``'s ``TransposedV``; the torch routes are described in docs/torch.md.
"""
from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "api.md"

#: (section title, module name, the names documented: None for the module's ``__all__``)
SECTIONS = [
    ("mla_cupy", "mla_cupy", None),
    ("mla_cupy.reference", "mla_cupy.reference", ["mla_prefill", "mla_prefill_fp8", "mla_prefill_fp8_rope",
                                                  "mla_prefill_chunked", "merge_states", "positions", "visible_pairs"]),
    ("mla_cupy.quant", "mla_cupy.quant", None),
    ("mla_cupy.fp8", "mla_cupy.fp8", ["TransposedV"]),
]
#: Names of ``mla_cupy.__all__`` that are modules or constants, listed without a docstring entry.
SKIP = {"__version__", "reference", "quant", "fp8"}


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""


def _entry(qualname: str, obj) -> str:
    kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else "value"
    if kind == "value":
        return "\n".join([f"### `{qualname} = {obj!r}`", ""])
    head = f"### `{qualname}{_signature(obj)}`"
    doc = inspect.getdoc(obj) or "(no docstring)"
    lines = [head, "", f"*{kind}*", "", "```text", doc, "```", ""]
    if inspect.isclass(obj):
        for name, member in sorted(vars(obj).items()):
            if name.startswith("_") or not (inspect.isfunction(member) or isinstance(member, property)):
                continue
            target = member.fget if isinstance(member, property) else member
            sig = "" if isinstance(member, property) else _signature(member)
            mdoc = inspect.getdoc(target) or "(no docstring)"
            lines += [f"#### `{qualname}.{name}{sig}`", "", "```text", mdoc, "```", ""]
    return "\n".join(lines)


def render() -> str:
    sys.path.insert(0, str(ROOT))
    import importlib

    parts = ["# API reference", "",
             "Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand. The operation",
             "itself is [contract.md](contract.md); the errors are [errors.md](errors.md).", ""]
    for title, modname, names in SECTIONS:
        mod = importlib.import_module(modname)
        names = names if names is not None else [n for n in getattr(mod, "__all__", []) if n not in SKIP]
        parts += [f"## {title}", ""]
        summary = (inspect.getdoc(mod) or "").split("\n\n")[0]
        if summary:
            parts += [summary, ""]
        for name in names:
            parts.append(_entry(f"{modname}.{name}", getattr(mod, name)))
    return "\n".join(parts).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with docs/api.md instead of writing it")
    a = ap.parse_args(argv)
    text = render()
    if a.check:
        if not OUT.exists() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT} is stale: run python docs/gen_api.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Optional dependencies: a missing one is named with the pip command that installs it (the
package's extras, installed from the checkout), never a bare ``ModuleNotFoundError``."""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

__all__ = ["EXTRA_OF", "MissingDependency", "require"]

#: The extra of this package that installs each optional module.
EXTRA_OF = {"torch": "torch", "transformers": "transformers", "matplotlib": "bench", "tqdm": "bench"}


class MissingDependency(ModuleNotFoundError):
    """An optional module is not installed; the message says which extra installs it."""


def require(module: str, what: str, extra: Optional[str] = None) -> ModuleType:
    """Import ``module`` for ``what`` (the feature that needs it), or raise
    :class:`MissingDependency`: ``"<what> needs <module>, which is not installed: pip install
    ".[<extra>]" in the mla_cupy checkout"`` (``extra``: the extra to name, default the module's own)."""
    top = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != top:  # the module is there, something it imports is not: not ours to explain
            raise
        extra = extra or EXTRA_OF.get(top)
        how = f'pip install ".[{extra}]" in the mla_cupy checkout' if extra else f"pip install {top}"
        raise MissingDependency(f"{what} needs {top}, which is not installed: {how}", name=top) from None

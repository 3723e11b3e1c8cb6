"""The ``mla-cupy`` command line from a checkout, without installing: ``python cli.py smoke``.

The command line itself is the package's (:mod:`mla_cupy.cli`, installed as ``mla-cupy``); this
file only puts the checkout first on ``sys.path`` and calls it. It is not part of the wheel.
"""
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # this checkout's mla_cupy, even if another is installed
    from mla_cupy.cli import main

    main()

"""Execute a notebook top to bottom with a Jupyter kernel of THIS Python interpreter, and store
its outputs (the stored quickstart's outputs come from a GPU run of this script).

A person runs the notebook with Jupyter itself, from anywhere::

    pip install ".[test]"                                 # in the checkout: the package, matplotlib, nbconvert
    jupyter nbconvert --to notebook --execute examples/quickstart.ipynb

This script is for the stored copy (from the repository root)::

    python examples/run_notebook.py                      # run examples/quickstart.ipynb, save it with its outputs
    python examples/run_notebook.py --out DIR/quickstart.ipynb   # ... saved there instead
    python examples/run_notebook.py --no-save            # run it, leave the file as it is
    python examples/run_notebook.py --plain              # its code cells in this process, no Jupyter

The kernel starts in the repository root and imports ``mla_cupy`` from this checkout. Before
saving, the outputs are searched for paths of this machine (:func:`machine_paths`): a stored
notebook carries none, so the script refuses to save one that does and names them.
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "quickstart.ipynb"

#: Name of the temporary kernelspec; the saved notebook keeps the standard "python3" one.
_KERNEL = "mla-cupy-run"

#: An absolute path of a machine (a home, an install prefix, a temporary or work folder).
MACHINE_PATH = re.compile(r"(?<![\w.])(/(home|root|opt|usr|tmp|var|work|srv|mnt)/[^\s'\"]*|[A-Za-z]:\\[^\s'\"]*)")


def machine_paths(nb) -> list:
    """The machine paths in the outputs of ``nb`` (text of every stream, result and error)."""
    found = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            texts = [out.get("text", "")] + [v for k, v in out.get("data", {}).items() if k.startswith("text/")]
            texts += out.get("traceback", [])
            for t in texts:
                found += [m.group(0) for m in MACHINE_PATH.finditer("".join(t) if isinstance(t, list) else t)]
    return found


def execute(path: Path, cwd: Path = ROOT, timeout: int = 600):
    """Run every cell of the notebook at ``path`` in a fresh kernel of ``sys.executable``.

    Parameters
    ----------
    path : Path
        The notebook file (read, not written).
    cwd : Path
        Working directory of the kernel (default: the repository root).
    timeout : int
        Seconds one cell may run (the first kernel call on a GPU compiles it).

    Returns
    -------
    nbformat.NotebookNode
        The notebook with its outputs. A cell that raises stops the run with
        ``nbclient.exceptions.CellExecutionError`` (its traceback names the cell).
    """
    import nbformat
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    nb = nbformat.read(str(path), as_version=4)
    kernelspec = nb.metadata.get("kernelspec")
    with tempfile.TemporaryDirectory() as tmp:
        # A kernelspec whose argv is this interpreter: another "python3" spec on the machine
        # (a user's or a system one) could point at a Python without this package.
        write_kernel_spec(Path(tmp) / _KERNEL)
        km = KernelManager(kernel_name=_KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[tmp]))
        NotebookClient(nb, km=km, timeout=timeout, record_timing=False,
                       resources={"metadata": {"path": str(cwd)}}).execute()
    if kernelspec is not None:
        nb.metadata["kernelspec"] = kernelspec
    return nb


def execute_plain(path: Path, cwd: Path = ROOT) -> str:
    """Run the notebook's code cells in order in THIS process, in one namespace, without Jupyter
    (for machines without a Jupyter kernel); returns what they printed. A cell that raises stops
    the run with its exception (the traceback names ``<cell N>``). Figures are drawn with
    matplotlib's non-interactive backend and not kept."""
    import contextlib
    import io
    import json
    import os

    import matplotlib

    matplotlib.use("Agg")  # no display in this mode; the Jupyter run shows the plot inline
    cells = json.loads(Path(path).read_text(encoding="utf-8"))["cells"]
    out = io.StringIO()
    namespace: dict = {"__name__": "__main__"}
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out):
            for i, cell in enumerate(c for c in cells if c["cell_type"] == "code"):
                exec(compile("".join(cell["source"]), f"<cell {i + 1}>", "exec"), namespace)
    finally:
        os.chdir(old)
    return out.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebook", nargs="?", type=Path, default=QUICKSTART)
    ap.add_argument("--no-save", action="store_true", help="do not write the outputs back into the file")
    ap.add_argument("--out", type=Path, default=None, help="save the executed notebook here instead of in place")
    ap.add_argument("--plain", action="store_true", help="run the code cells in this process without Jupyter; save nothing")
    args = ap.parse_args(argv)
    if args.plain:
        print(execute_plain(args.notebook), end="")
        print(f"ran the code cells of {args.notebook} without error")
        return 0
    import nbformat

    nb = execute(args.notebook)
    if args.no_save:
        print(f"ran {args.notebook}: every cell without error")
        return 0
    paths = machine_paths(nb)
    if paths:
        print(f"not saved: the outputs hold paths of this machine: {sorted(set(paths))}", file=sys.stderr)
        return 1
    target = args.out or args.notebook
    nbformat.write(nb, str(target))
    print(f"saved {target} ({target.stat().st_size / 1024:.0f} KiB) with its outputs")
    return 0


if __name__ == "__main__":
    sys.exit(main())

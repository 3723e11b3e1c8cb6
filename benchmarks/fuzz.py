"""Random problems against the float64 reference, in resumable ranges (the logic: tests/_fuzz.py).

    python benchmarks/fuzz.py --seed S --count N [--start I] [--budget-s B] [--out DIR]
    python benchmarks/fuzz.py --total N --out DIR      # resume from the records in DIR up to index N
    python benchmarks/fuzz.py --seed S --index I       # problem I alone (printed, run, shrunk if it fails)
    python benchmarks/fuzz.py --problem JSON           # one explicit problem, as a failure prints it
    python benchmarks/fuzz.py --seed S --count N --show   # the problems, without a GPU

``bash benchmarks/gpu.sh verify fuzz N`` runs it on a GPU machine; ``--help`` lists the options.
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the checkout's package and the tests' helpers

from _fuzz import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

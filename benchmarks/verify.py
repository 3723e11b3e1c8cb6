"""The reliability steps besides the fuzz (the logic: tests/_soak.py, tests/_verify.py).

    python benchmarks/verify.py soak [--calls N] [--threads T] [--iters I] [--no-torch] [--out DIR]
    python benchmarks/verify.py record-sanitizer TOOL LOG RC DIR    # the record of one sanitizer run
    python benchmarks/verify.py summary DIR                         # every record in DIR: one summary

``bash benchmarks/gpu.sh verify ...`` runs them; ``summary`` needs no GPU.
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the checkout's package and the tests' helpers

from _verify import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

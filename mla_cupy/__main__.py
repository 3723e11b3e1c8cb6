"""``python -m mla_cupy``: the ``mla-cupy`` command line."""
from .cli import main

if __name__ == "__main__":
    main()

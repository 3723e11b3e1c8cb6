"""One function run in several host threads at once (the concurrency tests)."""
from __future__ import annotations

import threading
from typing import Callable, List


def in_threads(work: Callable[[int], None], n: int = 8) -> List[Exception]:
    """Run ``work(i)`` for ``i`` in ``range(n)``, each in a thread of its own, all started before
    any is joined; return the exceptions they raised (empty when none did)."""
    errors: List[Exception] = []

    def run(i: int) -> None:
        try:
            work(i)
        except Exception as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors

"""A progress report on stderr for long host computations (the float64 reference): tqdm's bar
when tqdm is installed, otherwise a plain line rewritten in place (new lines when stderr is not a
terminal, at most one every few seconds)."""
from __future__ import annotations

import sys
import time

__all__ = ["Progress"]

#: Seconds between two plain lines when stderr is not a terminal.
_LINE_EVERY_S = 5.0


class Progress:
    """Work done out of ``total`` units, shown under ``desc`` when ``enabled``; a no-op otherwise.

    Use as a context manager; :meth:`update` adds done units."""

    def __init__(self, total: float, desc: str, enabled: bool):
        self.total, self.desc, self.enabled = max(float(total), 1.0), desc, enabled
        self.done = 0.0
        self._bar = None
        self._t0 = self._shown = time.perf_counter()
        if not enabled:
            return
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=100, desc=desc, unit="%", file=sys.stderr,
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]")
        except ImportError:
            self._line()

    def update(self, n: float) -> None:
        if not self.enabled:
            return
        before = self._percent()
        self.done = min(self.total, self.done + n)
        if self._bar is not None:
            self._bar.update(self._percent() - before)
        else:
            now = time.perf_counter()
            if sys.stderr.isatty() or now - self._shown >= _LINE_EVERY_S:
                self._shown = now
                self._line()

    def _percent(self) -> float:
        return 100.0 * self.done / self.total

    def _line(self) -> None:
        spent = time.perf_counter() - self._t0
        left = spent * (self.total - self.done) / self.done if self.done else float("nan")
        text = f"{self.desc}: {self._percent():3.0f}% ({spent:.0f} s" + (f", about {left:.0f} s left)" if left == left else ")")
        end = "\r" if sys.stderr.isatty() else "\n"
        print(text, end=end, file=sys.stderr, flush=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            self._line()
            if sys.stderr.isatty():
                print(file=sys.stderr)

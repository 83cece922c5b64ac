"""A small progress bar for long work (download, extract, model generation, benchmarks).

It draws on stderr when that is a terminal and prints a few plain lines otherwise, so logs of
CI runs stay readable.
"""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str, unit: str = "", enabled: bool = True, stream=None):
        self.total = max(int(total), 1)
        self.label = label
        self.unit = unit
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.count = 0
        self.start = time.monotonic()
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_draw = 0.0
        self._last_pct_logged = -1

    def update(self, n: int = 1) -> None:
        self.count += n
        if not self.enabled:
            return
        now = time.monotonic()
        if self._tty:
            if now - self._last_draw >= 0.1 or self.count >= self.total:
                self._last_draw = now
                self._draw(now)
        else:
            pct = int(100 * self.count / self.total) // 25 * 25
            if pct > self._last_pct_logged:
                self._last_pct_logged = pct
                print(f"{self.label}: {pct}% ({self.count}/{self.total} {self.unit})".rstrip(),
                      file=self.stream, flush=True)

    def _draw(self, now: float) -> None:
        frac = min(self.count / self.total, 1.0)
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        elapsed = now - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        self.stream.write(f"\r{self.label} [{bar}] {self.count}/{self.total} {self.unit} "
                          f"{elapsed:.0f}s elapsed, {eta:.0f}s left ")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._tty:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

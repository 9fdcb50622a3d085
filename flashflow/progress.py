"""Progress on stderr for commands that may run longer than a few seconds.

tqdm's bar when tqdm is installed (the ``bench`` extra), else a plain counter. Nothing is shown
for work that ends within ``delay`` seconds, so quick commands print only their result. With
``total=None`` (one long call that reports nothing while it runs, e.g. a search) the line shows
the elapsed time instead of a count, refreshed by a background thread. ``describe(text)`` says
which step is under way (drawn after the count); ``enabled=False`` shows nothing at all.

    with progress(len(items), "simulating") as bar:
        for item in items:
            bar.describe(item.label)
            ...
            bar.update()
"""
from __future__ import annotations

import sys
import threading
import time

DELAY = 2.0          # seconds of silence before anything is drawn
TICK = 1.0           # redraw period of the elapsed-time line
LOG_PERIOD = 10.0    # in a log (stderr not a terminal) an elapsed-time line at most this often


class _Counter:
    """The few tqdm calls used here, for machines without tqdm. On a terminal one line redraws
    itself; in a log a plain line is written every tenth of the way (or every LOG_PERIOD s)."""

    def __init__(self, total: int | None, desc: str, delay: float):
        self.total, self.desc, self.delay = total, desc, delay
        self.n = 0
        self.detail = ""
        self.start = self.last_log = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.drawn = False
        self.width = 0       # of the line last drawn on a terminal, to blank a longer one

    def _text(self) -> str:
        elapsed = f"{time.monotonic() - self.start:.0f} s"
        text = (f"{self.desc}: {elapsed}" if self.total is None
                else f"{self.desc}: {self.n}/{self.total} ({elapsed})")
        return f"{text} {self.detail}" if self.detail else text

    def _write(self, line_end: str) -> None:
        text = self._text()
        if self.tty:
            text, self.width = "\r" + text.ljust(self.width), len(text)
        sys.stderr.write(text + line_end)
        sys.stderr.flush()
        self.drawn = True

    def describe(self, text: str) -> None:
        self.detail = text
        # on a terminal the step under way is shown at once (it may be a long one); a log
        # gets it with the next count line
        if self.tty and time.monotonic() - self.start >= self.delay:
            self._write("")

    def update(self, n: int = 1) -> None:
        before, self.n = self.n, self.n + n
        now = time.monotonic()
        if now - self.start < self.delay:
            return
        if self.tty:
            self._write("")
        elif self.total is None:
            if now - self.last_log >= LOG_PERIOD or not self.drawn:
                self.last_log = now
                self._write("\n")
        elif self.n * 10 // max(self.total, 1) != before * 10 // max(self.total, 1) \
                or not self.drawn:
            self._write("\n")

    def close(self) -> None:
        if self.drawn and self.tty:
            self._write("\n")


class _Tqdm:
    def __init__(self, total: int | None, desc: str, delay: float):
        from tqdm import tqdm

        fmt = "{desc}: {elapsed}" if total is None else None
        # in a log (not a terminal) every redraw is kept: redraw rarely there
        self.bar = tqdm(total=total, desc=desc, file=sys.stderr, delay=delay, bar_format=fmt,
                        dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 30)
        self.last = 0.0

    def describe(self, text: str) -> None:
        self.bar.set_postfix_str(text, refresh=False)

    def update(self, n: int = 1) -> None:
        if n:
            self.bar.update(n)
            return
        # the elapsed-time line: tqdm redraws only on updates, so redraw here, as rarely as
        # tqdm itself would (mininterval) and not before its delay
        now = time.time()
        if now - self.bar.start_t >= self.bar.delay and now - self.last >= self.bar.mininterval:
            self.last = now
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


class _Silent:
    def describe(self, text: str) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class progress:
    """A progress line for ``total`` steps (or for one long call when ``total`` is None);
    a context manager. ``update(n)`` counts steps; ``describe(text)`` names the step under way;
    the elapsed-time line redraws itself. ``enabled=False``: nothing is drawn."""

    def __init__(self, total: int | None, desc: str, delay: float | None = None,
                 enabled: bool = True):
        delay = DELAY if delay is None else delay
        if not enabled:
            self._bar = _Silent()
        else:
            try:
                self._bar = _Tqdm(total, desc, delay)
            except ImportError:
                self._bar = _Counter(total, desc, delay)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if total is None and enabled:
            self._thread = threading.Thread(target=self._tick, name="flashflow-progress",
                                            daemon=True)
            self._thread.start()

    def _tick(self) -> None:
        while not self._stop.wait(TICK):   # read each time: tests shorten it
            with self._lock:
                self._bar.update(0)

    def update(self, n: int = 1) -> None:
        with self._lock:
            self._bar.update(n)

    def describe(self, text: str) -> None:
        with self._lock:
            self._bar.describe(text)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._bar.close()

    def __enter__(self) -> "progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

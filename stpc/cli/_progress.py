"""Progress on stderr for the verbs (tqdm). Shown only where it helps and never in the way:

* only when stderr is a terminal (tqdm's ``disable=None``: a pipe, a log file or a test's
  captured stream gets nothing) and the verb was not given ``--quiet``;
* work that blocks (a trace, a search) gets a one-line :class:`Status` that appears only
  once it has run for ``DELAY_S`` and is refreshed by a ticker thread, so a single long
  call (``torch.export``, one CP-SAT solve) still shows its elapsed time; it is erased
  when the work ends;
* loops with a known length (training steps, benchmark rounds) get a plain tqdm bar
  (:func:`bar`).

The search's line is drawn from ``stpc.planner.search``'s ``progress`` callback
(:class:`SearchStatus`): the candidate being solved, the incumbent (best modelled step
time so far), the lower bound and the gap between them, and the elapsed time.
"""
from __future__ import annotations

import sys
import threading
import time

from tqdm import tqdm

from stpc.planner.search import SearchProgress

DELAY_S = 1.0    # a Status appears only after this long
TICK_S = 0.2     # and is redrawn this often


def shown(enabled: bool = True) -> bool:
    """Whether progress goes to stderr: enabled (not --quiet) and stderr a terminal."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(enabled and isatty is not None and isatty())


class Status:
    """A one-line status of blocking work on stderr, shown after ``DELAY_S`` (module
    docstring). ``set(text)`` changes what it says; a context manager."""

    def __init__(self, desc: str, enabled: bool = True):
        self.desc, self.text = desc, ""
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = None
        if shown(enabled):
            self._thread = threading.Thread(target=self._tick, name="stpc-progress", daemon=True)
            self._thread.start()

    def set(self, text: str) -> None:
        self.text = text

    def _line(self) -> str:
        return "  ".join(x for x in (self.desc, self.text, f"{time.perf_counter() - self.t0:.1f} s") if x)

    def _tick(self) -> None:
        if self._stop.wait(max(0.0, DELAY_S - (time.perf_counter() - self.t0))):
            return
        line = tqdm(total=None, file=sys.stderr, leave=False, bar_format="{desc}", dynamic_ncols=True)
        try:
            while True:
                line.set_description_str(self._line(), refresh=True)
                if self._stop.wait(TICK_S):
                    return
        finally:
            line.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Status:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.4g} ms"


def describe(ev: SearchProgress) -> str:
    """One line for a search progress report."""
    if ev.phase == "done":
        text = f"done: {ev.candidate}"
    else:
        what = {"build": "building", "solve": "solving", "cpsat": "CP-SAT on"}.get(ev.phase, ev.phase)
        text = f"{what} {ev.candidate} ({ev.done + 1}/{ev.total})"
    if ev.incumbent_s is not None or ev.bound_s is not None:
        text += f"  incumbent {_ms(ev.incumbent_s)}  bound {_ms(ev.bound_s)}"
        if ev.incumbent_s and ev.bound_s is not None:
            text += f" (gap {max(0.0, 1 - ev.bound_s / ev.incumbent_s):.1%})"
    return text


class SearchStatus(Status):
    """A :class:`Status` fed by ``search(progress=...)``: pass the instance as the callback."""

    def __init__(self, desc: str = "search", enabled: bool = True):
        super().__init__(desc, enabled)
        self.last: SearchProgress | None = None

    def __call__(self, ev: SearchProgress) -> None:
        self.last = ev
        self.set(describe(ev))


def bar(total: int, desc: str, enabled: bool = True, **kwargs) -> tqdm:
    """A tqdm bar on stderr for a loop of ``total`` steps (off under --quiet or off a terminal)."""
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=None if enabled else True, dynamic_ncols=True,
                **kwargs)


__all__ = ["Status", "SearchStatus", "bar", "describe", "shown", "DELAY_S"]

"""The one bounded wait: a deadline, a poll, an early end, and the log tail on failure.

Every wait for something outside this process (a server's ``/health``, Ray nodes, a
reader) goes through ``wait_until``, so that none can hang and each failure says what
was awaited, for how long, why it ended, and what the awaited process logged last.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


class WaitTimeout(TimeoutError):
    """What was awaited did not happen before the deadline."""


class WaitAborted(RuntimeError):
    """The wait ended early: what it waited for cannot happen any more (a process exited)."""


def wait_until(what: str, ready: Callable[[], T], *, timeout: float, poll_s: float = 1.0,
               abort: Callable[[], str | None] = lambda: None,
               log_tail: Callable[[], str] = lambda: "",
               progress: Callable[[], str] = lambda: "",
               announce: Callable[[str], None] | None = None, announce_every_s: float = 15.0) -> T:
    """Poll ``ready`` until it returns something true, and return that; at most ``timeout`` s.

    ``abort`` is asked before each poll: a message from it ends the wait (``WaitAborted``).
    ``progress`` says how far it got (``"1 of 2 nodes"``), ``log_tail`` what the awaited
    process logged last; both go into the error. ``announce``, if given, gets a line every
    ``announce_every_s`` while the wait goes on: what it waits for, the seconds so far of the
    bound, and the progress (a long start says what it is at). ``ready`` is called at least
    once, even with ``timeout`` 0.
    """
    started = time.monotonic()
    deadline = started + max(0.0, timeout)
    next_announce = started + announce_every_s
    while True:
        if announce is not None and time.monotonic() >= next_announce:
            done = progress()
            announce(f"{what}: waiting, {time.monotonic() - started:.0f} s of {timeout:.0f} s"
                     + (f" ({done})" if done else ""))
            next_announce += announce_every_s
        reason = abort()
        if reason:
            raise WaitAborted(_message(f"{what}: {reason}", started, progress, log_tail))
        result = ready()
        if result:
            return result
        left = deadline - time.monotonic()
        if left <= 0:
            raise WaitTimeout(_message(f"{what}: not after {timeout:.0f} s", started, progress, log_tail))
        time.sleep(min(poll_s, left))


def _message(head: str, started: float, progress: Callable[[], str], log_tail: Callable[[], str]) -> str:
    text = head
    done = progress()
    if done:
        text += f" ({done})"
    text += f"; waited {time.monotonic() - started:.1f} s"
    tail = log_tail()
    if tail:
        text += f"\n--- last log lines ---\n{tail}"
    return text

"""Stopping on SIGINT / SIGTERM only between units of work, so a checkpoint is never torn.

A *unit* (``StopGuard.atomic()``) is a piece of trainer state that must change all at once:
an optimizer step together with the step counter, the trained sample ids and the weight
publish; taking a sample off the queue together with the received count; stopping the
rollout process together with the stage accounting. A signal that arrives inside a unit is
held and raised as :class:`Interrupted` when the unit ends; one that arrives between units is
raised at once. After the first one the guard is *stopping*: later signals (a second Ctrl-C
50 ms after the first) are only noted, so the shutdown and the checkpoint finish whatever
happens. The process then exits with ``128 + signal number`` (130 for SIGINT, 143 for
SIGTERM).
"""
import contextlib
import signal
import threading

from ..log import logger

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised in the trainer's main thread between units of work."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def exit_code(err: BaseException) -> int:
    """``128 + signal number``; a plain ``KeyboardInterrupt`` counts as SIGINT (130)."""
    return 128 + getattr(err, "signum", int(signal.SIGINT))


class StopGuard:
    """Installs SIGINT/SIGTERM handlers (main thread only) for the life of a training run."""

    def __init__(self):
        self.received = None        # the first signal number seen, if any
        self._pending = None        # held inside a unit, raised when it ends
        self._depth = 0
        self._stopping = False
        self._previous = {}

    def install(self) -> "StopGuard":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    @property
    def active(self) -> bool:
        """Whether this guard's handlers are installed (False outside the main thread)."""
        return bool(self._previous)

    def stopping(self) -> None:
        """From now on signals are only noted: the run is already on its way out."""
        self._stopping = True

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
        if self._stopping:
            logger.warning(f"{signal.Signals(signum).name} again: already stopping (writing the "
                           f"checkpoint, stopping the rollout process)")
            return
        if self._depth:
            self._pending = self._pending or signum
            return
        self._stopping = True
        raise Interrupted(signum)

    @contextlib.contextmanager
    def atomic(self):
        """Run the body as one unit: a signal arriving inside is raised when it ends (if the
        body raises, its exception goes on and the held signal only puts the guard in stopping
        mode)."""
        self._depth += 1
        try:
            yield
        except BaseException:
            self._depth -= 1
            if self._pending is not None:
                self._stopping = True
            raise
        self._depth -= 1
        if not self._depth and self._pending is not None and not self._stopping:
            signum, self._pending = self._pending, None
            self._stopping = True
            raise Interrupted(signum)

    @contextlib.contextmanager
    def ignoring_sigint(self):
        """SIGINT ignored at the OS level for the body: a child process started inside inherits
        SIG_IGN across exec, so a terminal's Ctrl-C (sent to the whole process group) never
        reaches it, not even while it imports. A SIGINT to this process during the body (a
        few ms) is lost; the caller keeps it short."""
        if not self.active:
            yield
            return
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

"""The example's own logger (``examples.async_trainer``) and a once-per-key warning."""
import logging
import sys

logger = logging.getLogger("examples.async_trainer")
_seen: set = set()


def warn_once(key: str, message: str) -> None:
    """Log ``message`` at WARNING level the first time ``key`` is seen in this process."""
    if key not in _seen:
        _seen.add(key)
        logger.warning(message)


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (pytest swaps it per test)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


def setup_logging(level: int = logging.INFO) -> None:
    """Show this example's and glm_kernels' messages on stderr (idempotent)."""
    for name in ("examples.async_trainer", "glm_kernels"):
        lg = logging.getLogger(name)
        if not lg.handlers:
            handler = _Stderr()
            handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s: %(message)s"))
            lg.addHandler(handler)
        lg.setLevel(level)
        lg.propagate = False

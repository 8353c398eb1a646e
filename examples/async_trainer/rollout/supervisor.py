"""The trainer's handle on one rollout process: start it, take its samples, stop it for sure.

Every sample the process puts on its queue ends up in exactly one count: received by the
trainer, drained from the queue at shutdown (``unconsumed``), or ``dropped`` (still in the
pipe of a process that died or had to be killed, so never readable).
"""
import queue
import time
from typing import Dict, Optional

from ..log import logger
from .local import rollout_worker
from .weight_sync import WeightSender


class RolloutError(RuntimeError):
    """The rollout process kept dying; the trainer stops (after writing its checkpoint)."""


class RolloutProcess:
    def __init__(self, cfg, ctx, tag: str, seed: int, mix: Dict[str, float], group_size: int,
                 prompts_per_step: int, queue_size: int, version: int = 0):
        self.tag = tag
        self.sender = WeightSender(ctx, cfg.rollout_torch_dtype(), version=version)
        self.queue = ctx.Queue(maxsize=queue_size)
        self.stop_ev, self._generated = ctx.Event(), ctx.Value("q", 0)
        self.received = 0
        self.proc = ctx.Process(target=rollout_worker, daemon=True, name=f"rollout {tag}",
                                args=(cfg, seed, mix, group_size, prompts_per_step,
                                      self.sender.receiver(),
                                      self.queue, self.stop_ev, self._generated, tag))
        self._started = False

    def start(self, guard, model):
        """Start the process (SIGINT ignored from its first instruction: the trainer owns its
        lifetime) and publish ``model`` to it as a full snapshot; returns PublishStats."""
        with guard.ignoring_sigint():
            self.proc.start()
        self._started = True
        _, stats = self.sender.send(model)
        return stats

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid

    @property
    def generated(self) -> int:
        """Samples the process has put on its queue."""
        return self._generated.value

    def alive(self) -> bool:
        return self.proc.is_alive()

    def get(self, timeout: float):
        """The next sample, or None after ``timeout`` seconds.

        Safe to call while the process may be dying: a sample is one small message (about
        500 bytes pickled, one write under PIPE_BUF, which a pipe takes whole), so a kill
        never leaves half of one to block on. Samples far larger than 4 KiB would need a
        framed transport instead."""
        try:
            sample = self.queue.get(timeout=timeout)
        except queue.Empty:
            return None
        self.received += 1
        return sample

    def _drain(self) -> int:
        n = 0
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                return n
            n += 1

    def shutdown(self, grace_s: float = 10.0) -> Dict[str, int]:
        """Stop the process (ask, then SIGTERM, then SIGKILL) and account for its samples.

        Returns ``generated``, ``unconsumed`` (drained here, never trained) and ``dropped``.
        """
        self.stop_ev.set()
        drained = 0
        if self._started:
            deadline = time.monotonic() + grace_s
            while self.proc.is_alive() and time.monotonic() < deadline:
                drained += self._drain()       # keep the pipe open so the worker can exit
                self.proc.join(timeout=0.05)
            if self.proc.is_alive():
                logger.warning(f"rollout {self.tag}: did not stop within {grace_s:g} s; "
                               f"terminating pid {self.pid}")
                self.proc.terminate()
                self.proc.join(timeout=2.0)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
            if self.proc.exitcode == 0:
                # A clean exit flushed the queue first: the rest is whole messages. After a
                # crash or a kill a message may be cut, and reading it could block forever.
                drained += self._drain()
        self.queue.close()
        generated = self.generated
        return {"generated": generated, "unconsumed": drained,
                "dropped": generated - self.received - drained}

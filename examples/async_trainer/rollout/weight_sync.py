"""Trainer -> rollout weights through ``glm_kernels.sync`` with ``delta=True``.

The trainer publishes ``model.state_dict()`` after every optimizer step on an IPC transport
(shared memory on CPU, CUDA IPC on GPU); the first version is a full snapshot, every later
one carries only the elements whose bits changed (the zstd delta codec). The rollout process
applies each version in place on its own model, in order, all-or-nothing; a refused update
leaves its weights untouched and makes the trainer's next publish a full snapshot.
"""
import torch

from glm_kernels import sync

from ..log import logger


class WeightSender:
    """Training side: one per rollout process (created before the process starts).

    ``version``: the last version published to an earlier rollout process of the same stage
    (a restart); numbering goes on from it, and the new channel's first publish is a full
    snapshot that the new receiver (holding nothing) accepts.
    """

    def __init__(self, ctx, dtype: torch.dtype, version: int = 0):
        self.link = sync.IpcTransport(ctx)
        self._sender = sync.Sender(self.link, delta=True, encoding="zstd", version=version)
        self.dtype = dtype
        self.version = version

    def receiver(self) -> "WeightReceiver":
        return WeightReceiver(self.link)

    def send(self, model):
        """Publish ``model``'s weights; returns the new version and its PublishStats."""
        # The rollout engine runs in ``dtype`` (bf16 by default, like an inference engine fed
        # by fp32 master weights): most bf16 weights do not move in one step, so the deltas
        # are small, and the sampler/trainer mismatch is what IcePop's gate is for.
        weights = {k: v.detach().to(self.dtype) if v.is_floating_point() else v.detach()
                   for k, v in model.state_dict().items()}
        self.version = self._sender.publish(weights)
        return self.version, self._sender.last_stats


class WeightReceiver:
    """Rollout side (picklable: travels to the spawned process)."""

    def __init__(self, link):
        self._link = link
        self._receiver = None

    @property
    def version(self) -> int:
        return 0 if self._receiver is None else self._receiver.version

    def poll(self, model, *, block: bool) -> int:
        """Apply every version waiting, in order; with ``block`` wait up to 1 s for the first
        when nothing has arrived yet. Returns the version held (0: none yet)."""
        if self._receiver is None:
            self._receiver = sync.Receiver(self._link, model.state_dict())
        try:
            if block and self._receiver.version == 0:
                self._receiver.receive(timeout=1.0)
            self._receiver.poll()
        except sync.SyncError as err:          # weights unchanged; a full snapshot follows
            logger.warning(f"rollout: weight update refused ({err}); keeping version "
                           f"{self._receiver.version} until the full snapshot arrives")
        return self._receiver.version

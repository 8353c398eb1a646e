"""Weight sync (docs/design.md 3.7): versioned named tensors from a trainer to rollout engines.

``Sender(transport, delta=True).publish(named_tensors) -> version`` on the training side;
``Receiver(transport, params).receive()/poll()`` on the rollout side, writing in place and
refusing (tensors unchanged) any update that does not apply exactly on the version it holds.
Transports: ``IpcTransport`` (colocated processes; CUDA IPC handles or CPU shared memory),
``BroadcastTransport`` (torch.distributed: NCCL on GPU, gloo on CPU), ``DiskTransport``
(safetensors files, atomic publish), ``LocalTransport`` (in-process), ``P2PTransport``
(sharded: several trainer ranks to sliced engine ranks, point to point). A Sender with a
``group`` / ``slices`` publishes each trainer rank's shard; ``FP8Blocks`` turns on FP8 rollout
weights. See docs/sync.md.
"""
from .disk import DiskTransport
from .dist import BroadcastTransport, P2PTransport
from .ipc import IpcTransport
from .local import LocalTransport
from .protocol import Entry, SyncError, Transport, TransportError, Update, VersionError
from .fp8 import FP8Blocks, quantize_fp8_blocks
from .receiver import ReceiveStats, Receiver
from .sender import PublishStats, Sender

__all__ = ["Sender", "Receiver", "PublishStats", "ReceiveStats", "SyncError", "VersionError",
           "TransportError", "Transport", "Update", "Entry", "LocalTransport", "IpcTransport",
           "BroadcastTransport", "DiskTransport", "P2PTransport", "FP8Blocks",
           "quantize_fp8_blocks"]

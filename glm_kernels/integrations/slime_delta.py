"""The path slime command lines name (``--custom-megatron-init-path
glm_kernels.integrations.slime_delta.install``): the code is
``glm_kernels.integrations.slime.delta``."""
from .slime.delta import (ENV_DEVICE_BYTES, ByteChanges, DeviceSnapshotDiff, device_budget,
                          encode_sync, install, overwrite_payload, read_delta, xor_payload)

__all__ = ["install", "DeviceSnapshotDiff", "ByteChanges", "encode_sync", "device_budget",
           "xor_payload", "overwrite_payload", "read_delta", "ENV_DEVICE_BYTES"]

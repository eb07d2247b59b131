"""Driver roles (Source, Transport + Receiver, EngineDriver) and the bucket manifest types.

Backends live one per module and are imported on demand, so importing this package stays light:
  refit.drivers.torch_source.TorchSource         torch nn.Module / state dict (DTensor aware)
  refit.drivers.megatron.MegatronSource          Megatron-Core through megatron-bridge's HF export
  refit.drivers.shm.SharedMemoryTransport        CPU shared memory (/dev/shm)
  refit.drivers.reference.ReferenceEngine        the reference CPU engine (process or thread)
"""

from refit.buckets import BucketManifest, TensorEntry, TensorMeta, plan_buckets
from refit.drivers.base import (
    PAUSE_MODES,
    ConnectInfo,
    EngineDriver,
    PauseMode,
    Payload,
    Receiver,
    Source,
    Transport,
)

__all__ = [
    "PAUSE_MODES",
    "BucketManifest",
    "ConnectInfo",
    "EngineDriver",
    "PauseMode",
    "Payload",
    "Receiver",
    "Source",
    "TensorEntry",
    "TensorMeta",
    "Transport",
    "plan_buckets",
]

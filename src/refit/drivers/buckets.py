"""The old path of `refit.buckets` (bucket planning and hashing left the drivers: issue 20).

Kept because `refit.protocol` still imports its manifest types from here by this name; every name
resolves to `refit.buckets`'s own object (classes pickle under `refit.buckets`). New code imports
`refit.buckets`.
"""

from typing import Any

import refit.buckets
from refit.buckets import BucketManifest, TensorEntry, TensorMeta

__all__ = ["BucketManifest", "TensorEntry", "TensorMeta"]


def __getattr__(name: str) -> Any:
    return getattr(refit.buckets, name)

"""A pickler that writes chosen objects as globals of another package, by name (no import).

SGLang's and vLLM's receivers unpickle what refit sends with their own classes and functions
(SGLang's patched CUDA rebuild, vLLM's `ncclUniqueId`); the trainer need not have either package,
so those references are written from their module and name alone. Everything else pickles as
Python's own pickler does (the pure-Python one: the C pickler imports every global it writes).
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any, BinaryIO


class ByNamePickler(pickle._Pickler):  # type: ignore[name-defined,misc]
    """`names`: object -> (module, qualified name) to write in its place, as a global."""

    def __init__(self, file: BinaryIO, names: Mapping[Any, tuple[str, str]], **kwargs: Any) -> None:
        super().__init__(file, protocol=pickle.DEFAULT_PROTOCOL, **kwargs)
        self._names = {id(obj): where for obj, where in names.items()}

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        where = self._names.get(id(obj))
        if where is None:
            super().save(obj, save_persistent_id)
            return
        memo = self.memo.get(id(obj))
        if memo is not None:
            self.write(self.get(memo[0]))
            return
        self.save(where[0])
        self.save(where[1])
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)

"""One registry of kinds: name -> what a kind is (its config class, model class, sizes, costs).

A registry maps a kind's name (the ``kind:`` of a config) to an *entry*: any object, usually
a frozen dataclass that bundles what the rest of the package needs to know about the kind
(torchtitan's ``ModelSpec``). Schema enums and CLI choices are ``registry.names()``, never
retyped; the code that builds a kind asks ``registry[name]`` and never switches on the name.

    MODELS = Registry("atomic model")
    MODELS.register("dimenetpp", AtomicModelKind(...))
    MODELS["dimenetpp"].build(cfg)
    MODELS.names()          # ("dimenetpp", ...): registration order

An entry may be registered *lazily*, as ``"module:attribute"``, imported the first time it is
asked for: the names are then known without importing what the entries need (the config and
Snakemake list every kind without importing torch). The registries of kinds are in
``gnnpipe.kinds``: the node models' convs (``CONVS``, entries in ``gnnpipe.models.<kind>``) and
the atomic models (``ATOMIC_MODELS``, entries in ``gnnpipe.atomic.protocol``).
"""

from __future__ import annotations

import importlib
from typing import Callable, Generic, Iterator, Optional, TypeVar, overload

T = TypeVar("T")


class UnknownKind(KeyError):
    """A name no entry is registered under (the message lists the known ones)."""

    def __str__(self) -> str:  # KeyError would print the repr of its argument
        return str(self.args[0])


class _Lazy(str):
    """A lazily registered entry: ``"module:attribute"``."""

    def load(self):
        module, _, attr = self.partition(":")
        return getattr(importlib.import_module(module), attr)


class Registry(Generic[T]):
    """Names -> entries, in registration order; a name is registered once."""

    def __init__(self, what: str):
        self.what = what  # "atomic model", "conv": what the error messages call an entry
        self._entries: dict[str, T] = {}

    def register_lazy(self, name: str, target: str) -> None:
        """Register the entry ``target`` = ``"module:attribute"``, imported when first asked for."""
        if ":" not in target:
            raise ValueError(f"{self.what} kind {name!r}: a lazy entry is 'module:attribute', got {target!r}")
        self.register(name, _Lazy(target))

    @overload
    def register(self, name: str, entry: T) -> T: ...

    @overload
    def register(self, name: str, entry: None = None) -> Callable[[T], T]: ...

    def register(self, name: str, entry: Optional[T] = None):
        """``register(name, entry)``, or ``@register(name)`` over the entry's definition."""
        def add(e: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.what} kind {name!r} is registered twice")
            self._entries[name] = e
            return e
        return add if entry is None else add(entry)

    def __getitem__(self, name: str) -> T:
        try:
            entry = self._entries[name]
        except KeyError:
            raise UnknownKind(f"unknown {self.what} kind {name!r}; known: {', '.join(self._entries)}") from None
        if isinstance(entry, _Lazy):
            entry = self._entries[name] = entry.load()
        return entry

    def get(self, name: str, default=None):
        return self[name] if name in self._entries else default

    def names(self) -> tuple[str, ...]:
        """Every registered name, in registration order (schema enums, CLI choices)."""
        return tuple(self._entries)

    def items(self):
        return [(name, self[name]) for name in self._entries]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}: {', '.join(self._entries)})"

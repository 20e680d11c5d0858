"""Typed dispatch by name: an object's handler for a message type is its ``on_<TypeName>``
method, looked up once per type and kept. Shared by the actor base and the sans-I/O
scheduler core (which imports no actor)."""
from __future__ import annotations

from typing import Any, Callable, Optional


def handler_for(obj: Any, cache: dict[type, Callable[..., Any]], typ: type) -> Optional[Callable[..., Any]]:
    """``obj.on_<typ.__name__>``, from ``cache`` once found; None when ``obj`` has none."""
    h = cache.get(typ)
    if h is None:
        h = getattr(obj, f"on_{typ.__name__}", None)
        if h is not None:
            cache[typ] = h
    return h

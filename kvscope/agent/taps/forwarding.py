"""Forwarding for the tap's wrappers: every public member of a vLLM base class that a wrapper
does not define itself goes to the object it wraps (``self.inner``), present members and those
a later vLLM release adds alike.

vLLM calls its offloading objects through their base classes (``OffloadingManager``,
``OffloadingWorker``, ``OffloadingSpec``, ``vllm/v1/kv_offload/base.py``), and every release
adds members with defaults there: 0.33 added ``OffloadingManager.lock`` (a property),
``on_reset_flushed`` and ``config_info``, ``OffloadingSpec.config_info_keys`` and an
``expedited`` argument to ``OffloadingWorker.submit_load``. A wrapper that inherited such a
default would silently answer for the object it wraps (a no-op lock around a manager whose
poll thread needs a real one). ``__getattr__`` cannot help: it is asked only for names the
class lacks, and the base class has them all. So the forwarding members are derived from the
base class when the wrapper class is made (:func:`forwards_to_inner`).

Imports only the standard library.
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Callable

FORWARDED = "__kvscope_forwarded__"  # attribute naming the members a class forwards


def public_members(base: type) -> dict[str, object]:
    """``name -> static attribute`` for every public member of ``base`` and its bases (names
    not starting with ``_``; ``object``'s own excluded)."""
    return {name: inspect.getattr_static(base, name) for name in dir(base)
            if not name.startswith("_")}


def calling(attribute: str, name: str):
    """A method that calls method ``name`` of the object in ``self.<attribute>`` with its
    arguments and returns what it returns."""
    def forward(self, *args, **kwargs):
        return getattr(getattr(self, attribute), name)(*args, **kwargs)
    forward.__name__ = name
    return forward


def reading(attribute: str, name: str, doc: str | None = None) -> property:
    """A read-only property: attribute ``name`` of the object in ``self.<attribute>``."""
    return property(lambda self: getattr(getattr(self, attribute), name),
                    doc=doc or f"The wrapped object's ``{name}``.")


def calling_each(attribute: str, names: tuple[str, ...]):
    """Class decorator: for each of ``names``, a method :func:`calling` that name of the object
    in ``self.<attribute>`` (applied under :func:`forwards_to_inner`, they are the class's own
    and not forwarded)."""

    def decorate(cls: type) -> type:
        for name in names:
            setattr(cls, name, calling(attribute, name))
        return cls

    return decorate


def forwards_to_inner(base: type, *, classmethod_target: Callable | None = None):
    """Class decorator: each public member of ``base`` that the decorated class does not define
    itself (in its own body or a base class other than ``base``'s line) forwards to
    ``self.inner``: methods call the inner object's method with the same arguments, properties
    read the inner object's, classmethods call ``classmethod_target(cls, *args, **kwargs)``,
    which returns ``(inner class, args, kwargs)`` to call the same classmethod on. The names are
    kept in ``cls.__kvscope_forwarded__``; :func:`bind_forwarded` turns the methods among them
    into the inner object's bound methods on an instance (no extra call frame). Raises
    TypeError for a base member of a kind it cannot forward (a plain class attribute that is
    not a constant) or a classmethod without ``classmethod_target``."""

    def decorate(cls: type) -> type:
        forwarded = []
        for name, member in public_members(base).items():
            own = inspect.getattr_static(cls, name)
            if own is not member:  # the wrapper defines it (or a class between them does)
                continue
            if isinstance(member, classmethod):
                if classmethod_target is None:
                    raise TypeError(f"{cls.__name__}: {base.__name__}.{name} is a classmethod; "
                                    "give classmethod_target")
                setattr(cls, name, classmethod(_classmethod(name, classmethod_target)))
            elif isinstance(member, property):
                setattr(cls, name, reading("inner", name))
            elif inspect.isfunction(member):
                setattr(cls, name, calling("inner", name))
            elif isinstance(member, (str, int, float, bool, type(None), frozenset, tuple)):
                continue  # a constant (e.g. a class-level default): nothing to forward
            else:
                raise TypeError(f"{cls.__name__}: cannot forward {base.__name__}.{name} "
                                f"({type(member).__name__})")
            forwarded.append(name)
        setattr(cls, FORWARDED, tuple(forwarded))
        abc.update_abstractmethods(cls)
        return cls

    return decorate


def _classmethod(name: str, target: Callable):
    def forward(cls, *args, **kwargs):
        inner_cls, args, kwargs = target(cls, *args, **kwargs)
        return getattr(inner_cls, name)(*args, **kwargs)
    forward.__name__ = name
    return forward


def bind_forwarded(wrapper: object) -> None:
    """Set each method ``type(wrapper)`` forwards as the inner object's bound method on
    ``wrapper`` itself, so a pass-through call costs what a call to the inner object costs.
    Properties and classmethods stay on the class (an instance attribute cannot shadow a
    property), and so does a method the inner object lacks (calling it raises as the inner
    object would)."""
    inner = wrapper.inner
    for name in getattr(type(wrapper), FORWARDED, ()):
        bound = getattr(inner, name, None)
        if bound is not None and inspect.isfunction(inspect.getattr_static(type(wrapper), name)):
            setattr(wrapper, name, bound)

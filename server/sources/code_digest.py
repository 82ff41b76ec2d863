"""A digest of what a user's callable (a preprocessing stage) computes, for the sequence
fingerprint: its code, its module's file, what it refers to in its own package, and the plain
values it holds (``callable_digest``)."""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable

import numpy as np
import xxhash

__all__ = ["callable_digest"]

PLAIN = (type(None), bool, int, float, complex, str, bytes)
OWN_PACKAGE = "fuelline"  # the project's own code counts by name: it is part of the version
MAX_DEPTH = 8  # containers and objects nested deeper than this count by their type only
MAX_ITEMS = 10_000  # a container longer than this counts by its type and length (an array: by its bytes)


def callable_digest(fn: Callable[..., Any]) -> str:
    """A short hex digest of what a user's callable (a preprocessing stage) computes, the same in
    every process and on every mount: so that a server restarted after the stage was edited under
    the same ``module:function`` is told apart from one running the same code.

    What counts:

    * a function: its code object (bytecode, constants with nested code objects, names, argument
      counts), its defaults and the values its closure cells hold;
    * the source file of its module, whole (an edited constant or helper beside it counts), and,
      followed by global name, the functions, classes and modules of the same top-level package
      that it refers to, with their files, and the plain values it refers to;
    * a callable instance: its class's methods and module file, and its attributes;
      ``functools.partial`` and bound methods: the function and what is bound to it.

    Values count where they are plain (numbers, strings, bytes, numpy arrays, and tuples, lists,
    sets and dicts of those, up to ``MAX_ITEMS`` items); objects of other packages count by their
    type's name only, and
    fuelline's own functions and classes by their names (they are part of its version), though the
    attributes of a stage that is itself such an object count. What the code reads at run time
    (other files, the environment) is not seen.

    ``marshal.dumps`` of a code object would be shorter to write, but its bytes depend on how many
    references each constant had in the process that wrote them, so the digest is built field by
    field instead.
    """
    inner = fn
    while isinstance(inner, (functools.partial, types.MethodType)):  # whose code it runs
        inner = inner.func if isinstance(inner, functools.partial) else inner.__func__
    d = _Digest(_top(getattr(inner, "__module__", None) or type(inner).__module__))
    d.value(fn, 0)
    return d.hexdigest()


class _Digest:
    """One callable's digest under construction: what was hashed so far, and what was met already
    (a function that calls itself, a module file reached twice)."""

    def __init__(self, package: str, seen: set[int] | None = None) -> None:
        self.package = package
        self.seen: set[int] = set() if seen is None else seen
        self._alive: list[Any] = []  # what ``seen`` holds the ids of, so that no id is reused meanwhile
        self._files: set[str] = set()
        self._h = xxhash.xxh3_64()

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def put(self, tag: str, data: bytes = b"") -> None:
        # Length-prefixed: no two sequences of fields run together into the same bytes.
        self._h.update(f"{tag}:{len(data)}:".encode())
        self._h.update(data)

    def _followed(self, module: Any) -> bool:
        top = _top(module)
        return top != OWN_PACKAGE and top in (self.package, "__main__")

    def _once(self, obj: Any) -> bool:
        if id(obj) in self.seen:
            return False
        self.seen.add(id(obj))
        self._alive.append(obj)
        return True

    def _sub(self, v: Any, depth: int) -> str:
        child = _Digest(self.package, set(self.seen))
        child.value(v, depth)
        return child.hexdigest()

    # -- values --------------------------------------------------------------------------------
    def value(self, v: Any, depth: int) -> None:
        if self._atom(v) or self._code_or_type(v, depth):
            return
        if depth > MAX_DEPTH or isinstance(v, (tuple, list, set, frozenset, dict)) and len(v) > MAX_ITEMS:
            self.put("opaque", f"{_name(type(v))}:{len(v) if hasattr(v, '__len__') else ''}".encode())
        elif not self._container(v, depth) and not self._bound(v, depth):
            self.instance(v, depth)

    def _atom(self, v: Any) -> bool:
        """A value that counts as it is, at any depth: a plain value, an array, a builtin, a module."""
        if isinstance(v, PLAIN):
            self.put(type(v).__name__, repr(v).encode("utf-8", "surrogatepass"))
        elif isinstance(v, np.ndarray):
            self.put("ndarray", f"{v.dtype.str}{v.shape}".encode())
            self.put("data", b"" if v.dtype.hasobject else np.ascontiguousarray(v).tobytes())
        elif isinstance(v, np.generic):
            self.put("numpy", v.dtype.str.encode() + (b"" if v.dtype.hasobject else v.tobytes()))
        elif isinstance(v, (types.BuiltinFunctionType, np.ufunc)):
            self.put("builtin", _name(v).encode())
        elif isinstance(v, types.ModuleType):
            self.put("module", v.__name__.encode())
            if self._followed(v.__name__):
                self.module_file(v.__name__)
        else:
            return False
        return True

    def _code_or_type(self, v: Any, depth: int) -> bool:
        if isinstance(v, types.CodeType):
            self.code(v, depth)
        elif isinstance(v, types.FunctionType):
            self.function(v, depth)
        elif isinstance(v, type):
            self.cls(v, depth)
        else:
            return False
        return True

    def _container(self, v: Any, depth: int) -> bool:
        if isinstance(v, (tuple, list)):
            self.put(type(v).__name__, str(len(v)).encode())
            for item in v:
                self.value(item, depth + 1)
        elif isinstance(v, (set, frozenset)):
            # Iteration order follows string hashing, which differs between processes: sorted.
            self.put(type(v).__name__, ",".join(sorted(self._sub(x, depth + 1) for x in v)).encode())
        elif isinstance(v, dict):
            items = sorted((self._sub(k, depth + 1), self._sub(x, depth + 1)) for k, x in v.items())
            self.put("dict", repr(items).encode())
        else:
            return False
        return True

    def _bound(self, v: Any, depth: int) -> bool:
        """A partial or a bound method: the function and what is bound to it."""
        if isinstance(v, functools.partial):
            self.put("partial")
            for part in (v.func, v.args, v.keywords):
                self.value(part, depth + 1)
        elif isinstance(v, types.MethodType):
            self.put("method", v.__func__.__name__.encode())
            self.value(v.__func__, depth + 1)
            self.value(v.__self__, depth + 1)
        else:
            return False
        return True

    def code(self, c: types.CodeType, depth: int) -> None:
        # Not the file name nor line numbers: the same code on two mounts, or moved down by a
        # comment, computes the same (the module file's bytes say whether it was edited).
        self.put("code", c.co_code)
        self.put("counts", f"{c.co_argcount},{c.co_posonlyargcount},{c.co_kwonlyargcount},{c.co_flags}".encode())
        for names in (c.co_names, c.co_varnames, c.co_freevars, c.co_cellvars):
            self.put("names", "\0".join(names).encode())
        self.put("consts", str(len(c.co_consts)).encode())
        for k in c.co_consts:
            self.value(k, depth + 1)

    def function(self, f: types.FunctionType, depth: int) -> None:
        self.put("function", _name(f).encode())
        if not self._followed(f.__module__) or not self._once(f):
            return  # another package's function, the project's own, or one met already: its name
        self.code(f.__code__, depth)
        self.value(f.__defaults__, depth + 1)
        self.value(f.__kwdefaults__, depth + 1)
        for cell in f.__closure__ or ():
            try:
                self.value(cell.cell_contents, depth + 1)
            except ValueError:  # a cell not filled yet
                self.put("empty cell")
        self.module_file(f.__module__)
        for name in sorted(_names(f.__code__)):
            if name in f.__globals__:
                self.put("global", name.encode())
                self.value(f.__globals__[name], depth + 1)

    def cls(self, c: type, depth: int) -> None:
        self.put("class", _name(c).encode())
        if not self._followed(c.__module__) or not self._once(c):
            return
        self.module_file(c.__module__)
        for base in c.__mro__:
            if not self._followed(base.__module__):
                continue
            for key, member in sorted(vars(base).items()):
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                elif isinstance(member, property):
                    member = member.fget
                if isinstance(member, types.FunctionType):
                    self.put("member", key.encode())
                    self.value(member, depth + 1)

    def instance(self, v: Any, depth: int) -> None:
        """An object: its class, and its attributes where it is the stage itself or of this
        package (another package's object, a logger say, would drag in state that is not code)."""
        self.put("instance")
        self.cls(type(v), depth)
        if depth > 0 and not self._followed(type(v).__module__) or not self._once(v):
            return
        try:
            state = dict(getattr(v, "__dict__", {}))
            for base in type(v).__mro__:
                slots = getattr(base, "__slots__", ())
                for slot in (slots,) if isinstance(slots, str) else slots:
                    if slot not in state and hasattr(v, slot):
                        state[slot] = getattr(v, slot)
        except Exception:  # an object that will not be looked into counts by its class
            self.put("opaque")
            return
        for key in sorted(state):
            self.put("attribute", key.encode())
            self.value(state[key], depth + 1)

    def module_file(self, module: str) -> None:
        """The bytes of a module's file, whole (where it has one)."""
        path = getattr(sys.modules.get(module), "__file__", None)
        if not path or path in self._files:
            return
        self._files.add(path)
        try:
            with open(path, "rb") as f:
                self.put("file", xxhash.xxh3_128_digest(f.read()))
        except OSError:
            self.put("file unreadable", module.encode())


def _names(c: types.CodeType) -> set[str]:
    """The global names a code object and the code nested in it refer to."""
    out = set(c.co_names)
    for k in c.co_consts:
        if isinstance(k, types.CodeType):
            out |= _names(k)
    return out


def _top(module: Any) -> str:
    return str(module).split(".")[0]


def _name(obj: Any) -> str:
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__qualname__
    return f"{getattr(obj, '__module__', None)}:{name}"

"""Heavy third-party imports made cheaper, without changing what they do (installed by the CLI and ``train``).

bitsandbytes decorates some of its CPU kernels with ``torch.compile`` at import (``backends/default/ops.py``,
``_try_torch_compile``). Decorating compiles nothing yet, but it imports TorchInductor and TorchDynamo's debugging
tools: 2.8-3.0 s of a 2-core machine (measured), in every process that imports bitsandbytes (or peft, which imports
it) — a fake-tensor replay or a GPU run never calls those CPU kernels. :func:`cheap_imports` installs an import hook
under which bitsandbytes' own import sees a lazy ``torch.compile``: it records the function and the arguments, and
calls the real ``torch.compile`` with them the first time the kernel runs. What runs is unchanged (bitsandbytes
falls back to the plain function when compiling fails, at decoration before, at the first call now).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

#: The package whose import runs under :func:`lazy_torch_compile`.
LAZY_COMPILE_PACKAGE = "bitsandbytes"


def lazy(compile_fn: Callable) -> Callable:
    """A ``torch.compile`` look-alike that defers ``compile_fn(model, **kwargs)`` to the first call of the result
    (both forms: ``compile(fn, **kw)`` and ``compile(**kw)(fn)``)."""

    def deferred(model: Any = None, **kwargs: Any) -> Any:
        if model is None:
            return lambda fn: deferred(fn, **kwargs)
        compiled = None

        @functools.wraps(model)
        def run(*args: Any, **kw: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(model, **kwargs)
            return compiled(*args, **kw)

        return run

    return deferred


@contextmanager
def lazy_torch_compile() -> Iterator[None]:
    """``torch.compile`` is :func:`lazy` inside (restored on exit)."""
    import torch

    real = torch.compile
    torch.compile = lazy(real)
    try:
        yield
    finally:
        torch.compile = real


class _LazyCompileLoader(importlib.abc.Loader):
    """Runs a package's import under :func:`lazy_torch_compile` (everything else is the real loader's)."""

    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        with lazy_torch_compile():
            self.inner.exec_module(module)

    def __getattr__(self, name: str) -> Any:  # resource readers, get_data, is_package...
        return getattr(self.inner, name)


class _LazyCompileFinder(importlib.abc.MetaPathFinder):
    """Finds :data:`LAZY_COMPILE_PACKAGE` with the other finders and wraps its loader (availability checks that
    only look for it, as transformers' and peft's do, get the same spec; the import runs it)."""

    def __init__(self) -> None:
        self._finding = False

    def find_spec(self, name: str, path=None, target=None):
        if name != LAZY_COMPILE_PACKAGE or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _LazyCompileLoader(spec.loader)
        return spec


def cheap_imports() -> None:
    """Install the import hook (idempotent; nothing to do once the package is imported)."""
    if LAZY_COMPILE_PACKAGE in sys.modules:
        return
    if not any(isinstance(f, _LazyCompileFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _LazyCompileFinder())


__all__ = ["cheap_imports", "lazy", "lazy_torch_compile", "LAZY_COMPILE_PACKAGE"]

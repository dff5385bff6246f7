"""Lets skyrl 0.3.0 import on Python 3.11; installed by scripts/install.sh with a .pth (no-op on 3.12+).

`skyrl/tinker/types.py` puts a `typing.TypedDict` (MultiModalKwargs) into a pydantic model, which pydantic
refuses on Python < 3.12. While that one module executes, `typing.TypedDict` is typing_extensions'; every
other module (transformers' processor kwargs, TRL) keeps typing's own. A .pth rather than an import in our
code because vLLM's spawned engine worker imports the module too, and no hook of ours runs there.
"""
import importlib.abc
import importlib.machinery
import sys

_MODULE = "skyrl.tinker.types"


class _TypingExtensionsTypedDictFor(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_with_typing_extensions_typeddict(module):
            import typing

            import typing_extensions

            original = typing.TypedDict
            typing.TypedDict = typing_extensions.TypedDict
            try:
                exec_module(module)
            finally:
                typing.TypedDict = original

        spec.loader.exec_module = exec_with_typing_extensions_typeddict
        return spec


if sys.version_info < (3, 12):
    sys.meta_path.insert(0, _TypingExtensionsTypedDictFor())

"""Python 3.11 compatibility for importing SkyRL (not needed on 3.12+).

`skyrl.tinker.types` declares `typing.TypedDict`s that pydantic rejects on Python < 3.12; pydantic accepts
`typing_extensions.TypedDict`, so alias it before SkyRL is imported. Import this module first.
"""
from __future__ import annotations

import sys
import typing


def apply() -> None:
    if sys.version_info < (3, 12):
        import typing_extensions

        typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]


apply()

"""Moved to :mod:`narwhal_build`; kept only for ``narwhal/app.py``'s import until it moves.

Delete this file once ``narwhal/app.py`` (moving to ``narwhal_runtime/app.py``)
imports ``core_build`` from :mod:`narwhal_build`.
"""

from __future__ import annotations

from narwhal_build import core_build

__all__ = ["core_build"]

from __future__ import annotations

from .corebuild import pure_requested, use_pure_core

# Before anything imports the core (see corebuild): NARWHAL_PURE_PYTHON=1.
if pure_requested():
    use_pure_core()

from __future__ import annotations

from .corebuild import pure_requested, use_pure_core

#: The version of the source tree (``narwhal --version`` prefers the installed distribution's).
__version__ = "0.1.0"

# Before anything imports the core (see corebuild): NARWHAL_PURE_PYTHON=1.
if pure_requested():
    use_pure_core()

"""Narwhal: the ``narwhal`` command.

Importing this package does nothing but define the version: the choice of
the core's build (``NARWHAL_PURE_PYTHON``) is made by the entry points that
honour it (:mod:`narwhal_build`).
"""

from __future__ import annotations

#: The version of the source tree (``narwhal --version`` prefers the installed distribution's).
__version__ = "0.1.0"

"""``narwhal serve --check-config``: the start-up checks of ``serve``, without serving.

A pre-flight for a config about to be rolled out (a new ConfigMap, a new
keys file): it runs every check ``narwhal serve`` makes before it opens its
listening socket, with the same one-line messages and exit statuses
(docs/operate.md, "Process log"), and stops there. So it reads the files
and the environment the config names, as ``serve`` would in the same place:

* the config file, parsed and validated (exit 2 on a bad one);
* the router built from it, as ``serve`` builds it: the API keys file read
  and parsed when ``auth = "api_keys"``, the engine credential's
  environment variable present and fit for a header, the tokenizer and chat
  template of ``model.tokenizer`` loaded (exit 2);
* the journal: its file writable if it exists, else its directory one a
  file can be created in (exit 1, ``cannot open journal ...``).

It never creates or changes a file, never binds a socket and never
contacts an engine: a port that is taken, an engine name that does not
resolve or an engine that does not answer are ``serve``'s to report.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Mapping

__all__ = ["check_config", "journal_problem"]


def journal_problem(path: str) -> OSError | None:
    """Why ``serve`` could not open the journal at ``path`` for appending, or ``None``.

    Opening an existing file for appending changes nothing; a file that
    does not exist yet is not created: its directory is checked instead.
    """
    if path == "-":
        return None  # standard output
    if os.path.lexists(path):
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
        except OSError as exc:
            return exc
        return None
    directory = os.path.dirname(path) or "."
    try:
        os.stat(directory)
    except OSError as exc:
        return exc
    if not os.path.isdir(directory):
        return _error(errno.ENOTDIR)
    if os.access(directory, os.W_OK | os.X_OK):
        return None
    read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    return _error(errno.EROFS if read_only else errno.EACCES)


def _error(code: int) -> OSError:
    return OSError(code, os.strerror(code))


def _engines(count: int, phase: str) -> str:
    return f"{count} {phase} engine{'' if count == 1 else 's'}"


def check_config(path: str, env: Mapping[str, str] | None = None) -> int:
    """Check ``path`` as ``narwhal serve --config path`` would; print one line; the exit status."""
    import time

    from narwhal_core.errors import ConfigError
    from narwhal_runtime.app import build_router, journal_failure, load_config

    try:
        config = load_config(path)
        # The router serve would build (sans-IO: nothing is opened or contacted).
        build_router(config, now=time.monotonic(), env=env)
    except ConfigError as exc:
        print(exc.line(), file=sys.stderr)
        return 2
    journal = config.journal.path
    problem = journal_problem(journal)
    if problem is not None:
        print(f"narwhal: {journal_failure(journal, problem)}", file=sys.stderr)
        return 1
    engines = _engines(len(config.engine.prefill), "prefill") + " and " + _engines(len(config.engine.decode), "decode")
    if config.engine.discovery != "static":
        engines = f"engines found by {config.engine.discovery} discovery"  # (not looked up here: no I/O)
    print(f"narwhal: config {path} is valid (listen {config.ingress.listen}, auth {config.ingress.auth}, "
          f"{engines}, journal {journal}); no socket was opened and no engine contacted")
    return 0

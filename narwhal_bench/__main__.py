import sys

from narwhal_build import use_pure_core_if_requested

# Before anything imports the core: NARWHAL_PURE_PYTHON=1 picks its sources.
use_pure_core_if_requested()

from narwhal_bench.cli import main  # noqa: E402

sys.exit(main())

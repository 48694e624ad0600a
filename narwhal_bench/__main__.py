import sys

from narwhal_bench.cli import main

sys.exit(main())

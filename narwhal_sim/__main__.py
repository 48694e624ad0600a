"""``python -m narwhal_sim --role prefill --listen 127.0.0.1:0``."""

import sys

from narwhal_sim.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

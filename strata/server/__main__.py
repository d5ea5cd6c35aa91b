"""`python -m strata.server [flags]`: the same as `strata serve [flags]`."""

from __future__ import annotations

import sys

from strata.server.launch import serve_main

if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))

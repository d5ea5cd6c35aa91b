"""`python -m strata.router [flags]`: the same as `strata router [flags]`."""

from __future__ import annotations

import argparse
import sys

from strata.router.cli import add_router_args, router_main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="strata router",
        description="A cache-aware gateway over data-parallel `strata serve` replicas.",
    )
    add_router_args(parser)
    return router_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

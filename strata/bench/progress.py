"""A progress bar on stderr (tqdm when installed and stderr is a terminal; silent otherwise)."""

from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int, desc: str, enabled: bool = True):
        self._bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(
                total=total,
                desc=desc,
                unit="req",
                leave=False,
                dynamic_ncols=True,
                file=sys.stderr,
            )

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

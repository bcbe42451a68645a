"""The atheris entry point every fuzz target shares (``python fuzz/<target>.py [libFuzzer flags]``).

A target defines ``one_input(data: bytes)`` and ends with::

    if __name__ == "__main__":
        from atheris_main import fuzz  # fuzz/ is the script's folder, so it is on sys.path
        fuzz(one_input)

atheris is imported only here, so the test suite can load a target without it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


def fuzz(one_input: Callable[[bytes], None]) -> None:
    """Instrument what is imported so far, then run libFuzzer on ``one_input`` with ``sys.argv``."""
    import atheris

    atheris.instrument_all()
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()

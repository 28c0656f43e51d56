"""A worker that reports which nbddp modules its rank has loaded (tests/test_sides.py)."""

import sys


def loaded_modules(ctx):
    return sorted(m for m in sys.modules if m.startswith("nbddp"))

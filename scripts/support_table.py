#!/usr/bin/env python3
"""Rewrite README.md's support table from a matrix report (see kvexport/matrix/support_table.py).

    python scripts/support_table.py build/tiny-matrix.json           # rewrite the table
    python scripts/support_table.py build/tiny-matrix.json --check   # exit 1 if the README differs
"""

import sys

from kvexport.matrix.support_table import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m kvexport.cli``: the ``kvexport`` command."""

from . import main

main()

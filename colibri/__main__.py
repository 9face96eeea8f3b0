"""`python -m colibri ...` is the same as the `colibri` command."""
import sys

from .cli import main

sys.exit(main())

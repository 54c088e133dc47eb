"""`python -m dllm.cli`: the `dllm` command."""
import sys

from . import main

sys.exit(main())

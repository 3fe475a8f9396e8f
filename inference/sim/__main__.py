"""Entry point: `python -m inference.sim --model … --hardware v100-sxm2-32gb [vLLM flags]`."""

import sys

from inference.sim.cli import main

sys.exit(main())

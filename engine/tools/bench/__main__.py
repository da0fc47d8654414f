"""`python -m engine.tools.bench`: the same as `python -m engine bench`."""

import argparse

from . import add_arguments, run

ap = argparse.ArgumentParser()
add_arguments(ap)
raise SystemExit(run(ap.parse_args()))

"""`kvc eval` with the engine's page size set (docs/accuracy.md, "Quest at 512: the page size"): the eval
runner builds its engines with EngineConfig's default page size (16), and a paged method's
`split(key, size = page_size)` must equal the engine's page, so Quest at pages of 8 needs both.
This wrapper changes only the engines' page size; everything else is `kvc eval` as is.

Usage: python bench/eval_page_size.py 8 --methods full,quest --budgets 512 --method-param page_size=8 ...
"""
import functools
import sys

import kvc.runtime.eval.runner as runner
from kvc.runtime.cli import main
from kvc.runtime.config import EngineConfig

page = int(sys.argv[1])
runner.EngineConfig = functools.partial(EngineConfig, page_size=page)
sys.exit(main(["eval", *sys.argv[2:]]))

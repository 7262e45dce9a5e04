"""Side-by-side: kvpool vs pure-Python nano-vllm / vLLM-v1 reference block managers (see --help)."""

import sys

from kvpool.bench.compare import main

sys.exit(main())

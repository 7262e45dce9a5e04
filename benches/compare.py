"""Side-by-side: kvpool vs pure-Python nano-vllm / vLLM-v1 reference block managers (see --help).

The comparison lives in benches/compare/ (the references, the adapters and the replay); this
script puts that folder on the import path and runs its ``compare.main``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "compare"))

from compare import main  # noqa: E402  (benches/compare/compare.py, found through the path above)

sys.exit(main())

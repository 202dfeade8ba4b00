"""Makes `import dsv4` resolve to bindings/python/dsv4 without installing it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

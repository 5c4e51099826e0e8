import sys
from pathlib import Path

# Shared helpers live next to the tests (pytest's importlib mode does not put this folder on
# sys.path).
sys.path.insert(0, str(Path(__file__).parent))

import sys
from pathlib import Path

# The torchrun workers import `tiny_models` from this folder as a script would; the tests
# share it the same way (pytest's importlib mode does not put test folders on sys.path).
sys.path.insert(0, str(Path(__file__).parent))

"""Settings for the whole test session (every package's tests and the benchmarks' smoke
tests)."""

import atexit
import os
import shutil
import tempfile

# One SmolLM2 conversion per session, shared by the tests and benchmark runs that need it
# (klppo_train.demo.smollm2.cache_dir, inherited by their subprocesses), without touching
# the user's own cache.
if not os.environ.get("KLPPO_CACHE_DIR"):
    os.environ["KLPPO_CACHE_DIR"] = tempfile.mkdtemp(prefix="klppo_test_cache_")
    atexit.register(shutil.rmtree, os.environ["KLPPO_CACHE_DIR"], ignore_errors=True)

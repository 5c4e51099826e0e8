"""Run under ``torchrun --nproc-per-node=2``: rank 1 hangs (does not join an all-reduce);
rank 0's collective gives up after the process group's timeout and names rank 1. Writes
what each rank saw to ``<out>/rank<r>.json``."""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from klppo_train.runtime.process_group import init_distributed, timed_out

TIMEOUT_S = 2.0


def main(out_dir: Path) -> None:
    rank, _ = init_distributed(TIMEOUT_S)
    seen: dict = {"rank": rank}
    if rank == 1:
        time.sleep(4 * TIMEOUT_S)  # hung past rank 0's timeout and its check-in wait
    else:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))
        except RuntimeError as err:
            lost = timed_out(err, TIMEOUT_S)
            seen.update(error=str(lost), waited_s=time.monotonic() - start)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(Path(sys.argv[1]))

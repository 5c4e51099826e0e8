"""Two plain processes (not torchrun, whose agent would stop rank 0 when rank 1 dies): rank 0
watches rank 1 (``PeerWatch``) while taking three objects from it; rank 1 then ends with
``release_watch`` (``release``) or dies (``die``, ``os._exit`` after writing the time). In
``release`` mode rank 1 first stays silent past the group's timeout, which a receive given a
timeout of its own waits out.
Usage: ``watch_worker.py RANK PORT MODE OUT_DIR``; writes ``<out_dir>/rank<r>.json``."""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from rollout import PeerWatch, recv_object, release_watch, send_object, wait_all

GROUP_TIMEOUT_S = 5
SILENT_S = 7  # past the group's timeout


def main(rank: int, port: int, mode: str, out_dir: Path) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    group = dist.ProcessGroupGloo(
        dist.PrefixStore("link", store), rank, 2, timedelta(seconds=GROUP_TIMEOUT_S)
    )
    out: dict = {}
    if rank == 0:
        watch = PeerWatch(group, 1, lambda line: out.update(lost_at=time.time()))
        if mode == "release":
            start = time.perf_counter()
            out["late"] = recv_object(group, 1, timeout=timedelta(seconds=60))
            out["late_waited_s"] = time.perf_counter() - start
        out["objects"] = [recv_object(group, 1) for _ in range(3)]  # the protocol goes on
        out["ended"] = watch.close(timeout=30)
        time.sleep(1)  # rank 1 has exited by now: a release must not turn into a loss
        out["lost"] = watch.lost
    else:
        if mode == "release":
            time.sleep(SILENT_S)
            wait_all(send_object(group, 0, "late"))
        for i in range(3):
            time.sleep(0.5)
            wait_all(send_object(group, 0, i))
        time.sleep(1)
        if mode == "die":
            (out_dir / "rank1.json").write_text(json.dumps({"died_at": time.time()}))
            os._exit(9)
        release_watch(group, 0)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)  # the link is not the default group: skip interpreter teardown


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))

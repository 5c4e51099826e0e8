"""Run under ``torchrun --nproc-per-node=2``: rank 0 trains (a 1-rank default group of its
own), rank 1 generates (another); a gloo group on the rendezvous store joins them, as
``async_training.rollout_ranks`` does. Rank 0 streams two weight versions (bf16) through
``WeightSync`` → ``StreamedEngine`` and sends an object; rank 1 loads the versions into an
``HFEngine``, checks its weights against the trainer's model, and finally
waits for a version that never comes. Writes ``<out_dir>/rank<r>.json``."""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from rollout_testing import EOS, PAD, tiny_model

from rollout import (
    HFEngine,
    HFEngineConfig,
    StreamedEngine,
    WeightSync,
    receive_weights,
    recv_object,
    send_object,
    wait_all,
)

TIMEOUT_S = 6


def trainer(bridge, out: dict) -> None:
    model = tiny_model(seed=1)
    sync = WeightSync(lambda: model.named_parameters(), StreamedEngine(bridge, 1), torch.bfloat16)
    out["first"] = sync.sync(version=1)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    start = time.perf_counter()
    sent = sync.sync(version=2)  # the receiver is still asleep: this must not wait for it
    out["second_sync_s"] = time.perf_counter() - start
    out["bytes"] = sent["rollout/weight_sync_bytes"]
    pending = send_object(bridge, 1, {"step": 3, "t": torch.arange(5)})
    sync.engine.close()
    wait_all(pending)
    assert recv_object(bridge, 1)["done"]
    time.sleep(TIMEOUT_S + 4)  # alive and silent while the generator waits for version 3


def generator(bridge, out: dict) -> None:
    engine = HFEngine(tiny_model(seed=0), HFEngineConfig(pad_token_id=PAD, eos_token_ids=(EOS,)))
    out["versions"] = [receive_weights(bridge, 0, engine)]
    time.sleep(2)  # the trainer's second sync has returned by now
    out["versions"].append(receive_weights(bridge, 0, engine))
    want = tiny_model(seed=1)
    with torch.no_grad():
        for p in want.parameters():
            p.mul_(0.5)
    got = dict(engine.model.named_parameters())
    out["max_diff"] = max(
        float((got[n].float() - p.to(torch.bfloat16).float()).abs().max())
        for n, p in want.named_parameters()
    )
    obj = recv_object(bridge, 0)
    out["object"] = [obj["step"], obj["t"].tolist()]
    wait_all(send_object(bridge, 0, {"done": True}))
    start = time.perf_counter()
    try:
        receive_weights(bridge, 0, engine)
    except RuntimeError as err:
        out["timeout"] = {"waited_s": time.perf_counter() - start, "error": str(err)[:200]}


def main(out_dir: Path) -> None:
    store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=60)))
    side = dist.PrefixStore("train" if rank == 0 else "generate", store)
    dist.init_process_group("gloo", store=side, rank=0, world_size=1)
    bridge = dist.ProcessGroupGloo(
        dist.PrefixStore("bridge", store), rank, world, timedelta(seconds=TIMEOUT_S)
    )
    out: dict = {"rank": rank, "own_world": dist.get_world_size()}
    (trainer if rank == 0 else generator)(bridge, out)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # Skip interpreter teardown (as the other workers do): the bridge group is not the
    # default one and the last receive timed out on purpose.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

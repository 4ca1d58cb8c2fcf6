"""One rank under torchrun --max-restarts 1 (from test_elastic.py). Attempt 0 does its work, writes
its record, then rank 1 SIGKILLs itself; attempt 1 does the same work and ends normally.

argv: output JSON Lines file [, checkpoint directory: the drop-in with ep_size=2 trains a step].
Without a checkpoint: the world and a subgroup each sum the ranks' 1s and 2s, and the record names
the attempt's token and where this rank's keys landed in the agent's store."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import automoe  # noqa: F401  (puts the attempt scoping in front of env://, as for any user)
from automoe import elastic


def main() -> None:
    out = Path(sys.argv[1])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rec = {"attempt": attempt, "rank": rank}
    if len(sys.argv) > 2:
        from automoe import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32, ep_size=2)
        model.train()
        ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(rank))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        rec["loss"] = loss.item()
    else:
        raw = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                            timeout=timedelta(seconds=30))
        token = raw.get(elastic.PREFIX + "current").decode()
        t = torch.tensor([1.0 + rank])
        dist.all_reduce(t)
        sub = dist.new_group([0, 1])
        s = torch.tensor([1.0 + rank])
        dist.all_reduce(s, group=sub)
        key = f"probe-{attempt}-{rank}"
        dist.distributed_c10d._get_default_store().set(key, "1")
        earlier = [json.loads(l)["token"] for l in out.read_text().splitlines()] if out.exists() else []
        keys = raw.list_keys()
        rec.update(token=token, sum=t.item(), subgroup_sum=s.item(),
                   own_key_under_token=any(k.startswith(f"{elastic.PREFIX}{token}/") and k.endswith(key) for k in keys),
                   own_key_under_old_token=any(k.startswith(f"{elastic.PREFIX}{old}/") and k.endswith(key)
                                               for k in keys for old in earlier if old != token),
                   unscoped_keys=[k for k in keys if not k.startswith(elastic.PREFIX)])
    with open(out, "a") as f:
        f.write(json.dumps(rec) + "\n")
    dist.barrier()
    if attempt == 0:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)  # torchrun stops this rank when it sees rank 1's death
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

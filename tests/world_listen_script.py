"""Run as each rank of a job that torchrun did not start: RANK, WORLD_SIZE, MASTER_ADDR/PORT set.

Usage: ``python world_listen_script.py OUT_DIR``. The fit forms the default
process group from the environment; rank 0 then writes every TCP socket in
LISTEN state on MASTER_PORT (address, port) that its process holds.
"""

import json
import os
import sys
from pathlib import Path

import torch

from sklearn_casgd import CASGDLogisticRegression
from sklearn_casgd.datasets import make_glm_data

torch.set_num_threads(1)
X, y, _ = make_glm_data("logistic", 300, 4, random_state=0)
CASGDLogisticRegression(n_devices="world", max_iter=2, tol=None, timeout=30).fit(X, y)
if os.environ["RANK"] == "0":
    port = int(os.environ["MASTER_PORT"])
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    listening = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port and fields[9] in mine:
                listening.append(address)
    Path(sys.argv[1], "listening.json").write_text(json.dumps(listening))

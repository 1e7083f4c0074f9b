"""`redis_url: local`: the launcher's own Redis has a generated password that no process
listing shows, refuses clients without it, and the workers use it (L4 entries are written)."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest
import redis

from pdserve.cluster.config import Pipeline, WorkerGroup
from pdserve.cluster.launcher import Cluster, free_port
from pdserve.envs import REDIS_PASSWORD
from pdserve.kvstore.config import KVStoreConfig
from tests.cluster.conftest import get_text, post

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x)


def every_cmdline() -> list[bytes]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes())
        except OSError:
            pass
    return out


def test_local_redis_password_is_private_and_required(tiny_served_model):
    model = str(tiny_served_model)
    pipeline = Pipeline(
        # 12 blocks: a few prompts evict blocks, which are written down to Redis.
        model=model,
        port=free_port(),
        collocated=WorkerGroup(kv_cache_bytes=12 * 16 * 512, threads=1),
        # A loaded CI machine can take longer than the default 0.25 s for the first
        # authenticated connection; a timeout there marks the tier down and drops the puts.
        kv_pool=KVStoreConfig(redis_url="local", async_puts=False, redis_timeout_s=5.0),
    )
    cluster = Cluster(pipeline, log_level="WARNING")
    with cluster as url:
        procs = {p.name: p.popen for p in cluster.processes}
        password = environ(procs["collocated-0"].pid)[REDIS_PASSWORD]
        assert len(password) >= 32
        assert REDIS_PASSWORD not in environ(procs["router"].pid)  # only workers need it
        assert not [c for c in every_cmdline() if password.encode() in c]
        spec = Path(f"/proc/{procs['collocated-0'].pid}/cmdline").read_bytes().decode()
        port = int(re.search(r"redis://127\.0\.0\.1:(\d+)/0", spec).group(1))
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=5).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, password="guess", socket_timeout=5).ping()
        assert redis.Redis(port=port, password=password, socket_timeout=5).ping()
        # The worker writes evicted blocks to L4, with the password from its environment.
        # The first prompts come back from L4: read with the same password.
        for i in [*range(12), 0, 1]:
            body = {"model": model, "prompt": [60 + i] * 40, "max_tokens": 2, "temperature": 0}
            post(url, "/v1/completions", body)
        deadline = time.monotonic() + 20
        hits = r'pdserve_kv_cache_hits_total\{tier="L4",worker="collocated-0"\} [1-9]'
        while not re.search(hits, get_text(url, "/metrics")):
            assert time.monotonic() < deadline, get_text(url, "/metrics")
            time.sleep(0.3)

"""Entry point of a worker process (started only by the launcher):

PDSERVE_CLUSTER_SECRET=<hex> python -m pdserve.workers.main --spec '<WorkerSpec JSON>'
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys

from pdserve import envs
from pdserve.workers.spec import WorkerSpec


def main(argv: list[str] | None = None) -> int:
    envs.set_worker_thread_wait()  # before torch loads libgomp (the Worker import below)
    ap = argparse.ArgumentParser(prog="pdserve-worker")
    ap.add_argument("--spec", required=True, help="WorkerSpec as JSON")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    spec = WorkerSpec.from_json(args.spec)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s {spec.worker_id} %(levelname)s %(name)s: %(message)s",
    )
    from pdserve.workers.worker import Worker

    try:
        worker = Worker(spec, envs.cluster_secret())
    except ValueError as e:
        print(f"pdserve worker {spec.worker_id}: error: {e}", file=sys.stderr)
        return 2

    def stop(signum, frame):
        worker.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    worker.run()
    # Sockets, shm and files are closed (Worker.close). What is left is the interpreter's
    # last collection over every object the model, tokenizer and torch made: 2-4 s of
    # gc_collect_main on a loaded 2-core host, past the launcher's 5 s grace (then SIGKILL).
    # Frozen objects are not traversed, so the process exits at once.
    gc.freeze()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Issue #44, finding 4: memory of an engine's KV-event publisher while replay clients ask and never read.

This process holds only the publisher (a full buffer of `--batches` batches of about `--batch-bytes` each);
`--clients` DEALERs in another process each ask for the whole buffer and never read. Prints this process's
RSS before and over `--seconds`. Loopback only.

    PYTHONPATH=.shim python benchmarks/bench_kv_events_replay_memory.py
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

from kubeinfer.engine.core.kv_event_publisher import KVEventsConfig, ZmqEventPublisher
from kubeinfer.engine.core.kv_events import AllBlocksCleared, KVEventBatch

CLIENTS = """
import sys, time, zmq
ctx = zmq.Context()
socks = []
for _ in range(int(sys.argv[2])):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    s.connect(sys.argv[1])
    s.send_multipart([b"", (0).to_bytes(8, "big")])
    socks.append(s)
time.sleep(float(sys.argv[3]))
"""


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=150)
    parser.add_argument("--batches", type=int, default=1000)
    parser.add_argument("--batch-bytes", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    config = KVEventsConfig.parse({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
                                   "replay_endpoint": "tcp://127.0.0.1:*", "buffer_steps": args.batches})
    publisher = ZmqEventPublisher(config)
    for _ in range(args.batches):  # AllBlocksCleared is one byte of msgpack: as many as the size asks
        publisher.publish(KVEventBatch(ts=0.0, events=[AllBlocksCleared()] * args.batch_bytes))
    while publisher._next_seq < args.batches:
        time.sleep(0.01)
    before = rss_mib()
    clients = subprocess.Popen([sys.executable, "-c", CLIENTS, publisher.replay_endpoint, str(args.clients),
                                str(args.seconds + 5)])
    try:
        start = time.time()
        for mark in (args.seconds / 4, args.seconds / 2, args.seconds):
            time.sleep(max(0.0, start + mark - time.time()))
            print(f"t={mark:4.0f} s  RSS {before:.0f} -> {rss_mib():.0f} MiB", flush=True)
    finally:
        clients.kill()
        publisher.shutdown()


if __name__ == "__main__":
    main()

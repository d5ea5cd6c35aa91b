"""KV bytes/s between a prefill and a decode worker's transports, built-in TCP vs Mooncake, same run.

Each backend gets a sender (a prefill worker's transport) and a receiver (a decode worker's) on
loopback; a message of one KV payload is sent and the clock stops when the receiver's recv()
returns its frames (for Mooncake: pulled by the transfer engine, and its ack taken by the sender).
Payload sizes are KV of whole prompts: the default model (SmolLM2-135M, bf16 KV) holds about
23 KiB per token, so 1,000 prompt tokens are ~23 MiB.

    .venv/bin/python scripts/bench_pd_transfer.py --sizes-mib 0.25 1 23 64 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from strata.disagg.transport import TRANSFER_BACKENDS, make_transport


def one_transfer(sender, receiver, payload: bytes) -> float:
    start = time.perf_counter()
    sender.send(receiver.endpoint, [b"kv-header", payload])
    while (frames := receiver.recv()) is None:
        sender.recv()
    elapsed = time.perf_counter() - start
    assert frames[1] == payload
    for _ in range(1000):  # let the sender take its ack, outside the timing
        sender.recv()
        if not getattr(sender, "staged", None):
            break
        time.sleep(0.001)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backends",
        nargs="+",
        default=list(TRANSFER_BACKENDS),
        choices=list(TRANSFER_BACKENDS),
    )
    parser.add_argument("--sizes-mib", nargs="+", type=float, default=[0.25, 1, 23, 64])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(s * 2**20) for s in args.sizes_mib]
    print(f"{'payload':>10} " + " ".join(f"{b + ' MiB/s':>16}" for b in args.backends))
    pairs = {
        b: (
            make_transport(b, "127.0.0.1", 0, 0),
            make_transport(b, "127.0.0.1", 0, max(sizes)),
        )
        for b in args.backends
    }
    try:
        for size in sizes:
            payload = os.urandom(size)
            row = []
            for backend in args.backends:
                sender, receiver = pairs[backend]
                one_transfer(
                    sender, receiver, payload
                )  # warm-up: connections, handshakes
                times = [
                    one_transfer(sender, receiver, payload) for _ in range(args.repeats)
                ]
                row.append(f"{size / statistics.median(times) / 2**20:>16.0f}")
            print(f"{size / 2**20:>7.2f} MiB " + " ".join(row), flush=True)
    finally:
        for sender, receiver in pairs.values():
            sender.close()
            receiver.close()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""How long one fdatasync of an 8 KiB write takes on this machine's disk, back to back and
after a pause (the pause spent sleeping or spinning on the CPU), as a commit at one run at a
time pays it. Usage: fsync_gap.py DIR (a directory on the disk Postgres writes its WAL to,
e.g. /var/lib/postgresql); prints p50 and p90 in ms per pause."""
import os
import statistics
import sys
import time

ROUNDS = 150
PAUSES = [(0, False), (0.001, False), (0.002, False), (0.005, False), (0.02, False), (0.02, True)]


def run(fd: int, pause: float, spin: bool) -> tuple[float, float]:
    buf = b"x" * 8192
    took = []
    for i in range(ROUNDS):
        os.pwrite(fd, buf, (i % 100) * 8192)
        began = time.perf_counter()
        os.fdatasync(fd)
        took.append(time.perf_counter() - began)
        if spin:
            until = time.perf_counter() + pause
            while time.perf_counter() < until:
                pass
        elif pause:
            time.sleep(pause)
    took.sort()
    return statistics.median(took) * 1e3, took[int(len(took) * 0.9)] * 1e3


def main() -> None:
    path = os.path.join(sys.argv[1] if len(sys.argv) > 1 else ".", "fsync_gap.probe")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for pause, spin in PAUSES:
            p50, p90 = run(fd, pause, spin)
            how = "spinning" if spin else "sleeping"
            print(f"pause {pause * 1e3:4.0f} ms ({how}): fdatasync p50 {p50:.3f} ms, p90 {p90:.3f} ms")
    finally:
        os.close(fd)
        os.unlink(path)


if __name__ == "__main__":
    main()

"""Run a command while every core spins in a busy loop: the suite must pass on a busy machine.

    python scripts/under_load.py python -m pytest -q

One spinning process per core (`os.cpu_count()`, or --procs), started before the command and
killed after it; the command's exit status is this script's, and its wall time is printed.
"""
import argparse
import multiprocessing
import os
import subprocess
import sys
import time


def spin() -> None:
    x = 0
    while True:
        x = (x * 1103515245 + 12345) % 2147483648


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, default=os.cpu_count(), help="busy processes (default: one per core)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if not args.command:
        parser.error("give a command to run under load")
    busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.procs)]
    for p in busy:
        p.start()
    start = time.perf_counter()
    try:
        status = subprocess.call(args.command)
    finally:
        for p in busy:
            p.kill()
    print(f"under_load: {args.procs} busy processes; {' '.join(args.command)} took "
          f"{time.perf_counter() - start:.0f} s, exit status {status}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())

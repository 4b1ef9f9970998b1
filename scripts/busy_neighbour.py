"""A noisy neighbour for measurements and CI rehearsals on this 2-core machine: one process that keeps one core
busy a fraction of the time, in short bursts (default 10 ms on, 10 ms off: half a core), until it is stopped or
`--seconds` pass. Run it beside a benchmark or the suite to see what a shared machine does to them:

    python scripts/busy_neighbour.py &  NEIGHBOUR=$!;  bash scripts/test.sh;  kill $NEIGHBOUR
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--on-ms", type=float, default=10.0, help="busy time of each burst (default 10)")
    parser.add_argument("--off-ms", type=float, default=10.0, help="idle time after each burst (default 10)")
    parser.add_argument("--seconds", type=float, default=None, help="stop after this long (default: run until killed)")
    args = parser.parse_args()
    if args.on_ms <= 0 or args.off_ms < 0:
        parser.error("--on-ms must be > 0 and --off-ms >= 0")
    end = None if args.seconds is None else time.monotonic() + args.seconds
    while end is None or time.monotonic() < end:
        burst_end = time.monotonic() + args.on_ms / 1000
        while time.monotonic() < burst_end:
            pass
        time.sleep(args.off_ms / 1000)


if __name__ == "__main__":
    main()

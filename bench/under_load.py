"""Run the test suite with CPU-burning processes beside it: a test's outcome must not depend on how busy the
machine is (CI machines are shared; timeouts, tolerances and collective deadlines must hold under load).

    python bench/under_load.py -- -n 2              # 2 busy processes (every core of a 2-core machine), pytest -q -n 2
    python bench/under_load.py --burners 4 -- tests/test_distributed.py -x

Each burner is a Python process spinning on arithmetic at normal priority. They are stopped when pytest ends
(also on Ctrl-C). The exit status is pytest's.

Run it in a checkout that nothing edits meanwhile (a test that starts a program imports the files as they are
then), placed beside ../shared as this one is: elsewhere the GSM8K and real-model tests skip (`-rs` lists why).
"""

from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys
import time


def burn() -> None:
    value = 0
    while True:
        value = (value * 1_103_515_245 + 12_345) % 2**31


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--burners", type=int, default=multiprocessing.cpu_count(),
                        help="busy processes beside the suite (default: one per core)")
    parser.add_argument("pytest_args", nargs="*", help="arguments for pytest (after --)")
    args = parser.parse_args(argv)
    burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(args.burners)]
    for process in burners:
        process.start()
    started = time.perf_counter()
    try:
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", *args.pytest_args])
    finally:
        for process in burners:
            process.terminate()
        for process in burners:
            process.join()
    print(f"{args.burners} burners beside the suite; {time.perf_counter() - started:.0f} s; pytest exit "
          f"{result.returncode}", flush=True)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())

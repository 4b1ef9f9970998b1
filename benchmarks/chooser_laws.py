"""The clock of the automatic budget's oracle test (tests/test_chooser_oracle.py): per GPU (H100, H200), batch
size (1 to 64) and arm (plain decoding; MFD's K-mode and MFD_D's single-mode trees at budgets 4 to 64), the GPU
cost ledger's predicted round for Qwen3-8B (`mfd_sglang.gpu_ledger.arm_round_rows`). No GPU needed (about 8
minutes on 2 cores). Writes the rows as JSON and prints the test's LEDGER_MS table:

    python benchmarks/chooser_laws.py --out benchmarks/results/chooser-laws-qwen3-8b-DATE.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mfd_sglang.gpu_ledger import arm_round_rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    args = parser.parse_args(argv)
    rows = arm_round_rows(progress=lambda line: print(line, file=sys.stderr, flush=True))
    args.out.write_text(json.dumps({"command": "python benchmarks/chooser_laws.py --out " + str(args.out),
                                    "rows": rows}, indent=1) + "\n")
    table: dict = {}
    for row in rows:  # rows come per device and batch size in the test's ARMS order
        table.setdefault(row["device"], {}).setdefault(row["bs"], []).append(row["round_ms"])
    print("LEDGER_MS = {")
    for device, by_bs in table.items():
        print(f'    "{device}": {{')
        for bs, ms in by_bs.items():
            print(f"        {bs}: ({', '.join(f'{v:.3f}' for v in ms)}),")
        print("    },")
    print("}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

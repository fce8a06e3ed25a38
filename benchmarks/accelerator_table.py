"""The accelerator suite's table from the JSON files under its OUT folder (accelerator.sh)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

GiB = 2**30


def main() -> None:
    out = Path(sys.argv[1])
    rows = ["shape   compile  tokens/s    MFU    step split fwd/bwd/opt/other    peak mem / plan   "
            "compile s  torchtitan tokens/s  ratio"]
    for path in sorted(out.glob("bench-*.json")):
        b = json.loads(path.read_text())
        shape = path.stem.removeprefix("bench-").rsplit("-", 1)[0]
        compiled = "on" if b["compile"] else "off"
        split = "/".join(f"{b['phases'][k] / b['step_s']:.0%}" for k in ("forward", "backward", "optimizer", "other"))
        mfu = f"{b['mfu']:.1%}" if b["mfu"] is not None else "-"
        peer_file = out / f"peer-{shape}-{'true' if b['compile'] else 'false'}.json"
        peer = json.loads(peer_file.read_text()).get("tokens_per_s") if peer_file.is_file() else None
        ratio = f"{b['tokens_per_s'] / peer:.2f}x" if peer else "-"
        rows.append(f"{shape:<8}{compiled:<9}{b['tokens_per_s']:>9,.0f}  {mfu:>6}    {split:<30}  "
                    f"{b['mem_peak_bytes'] / GiB:6.2f} / {b['plan_bytes'] / GiB:6.2f} GiB  {b['compile_s']:8.1f}  "
                    f"{peer if peer else '-':>19}  {ratio}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

"""Compare ``bench/generate.py`` rows of two commits run side by side: tok/s ratios and digests, row by row.

Each ``--before`` / ``--after`` file is one run's JSON list; with several per side (runs interleaved, e.g. before,
after, after, before) a row's tok/s is the median over that side's runs. A row passes when after / before is at
least ``1 - --tolerance`` and every run of both sides has the same digest (the same tokens and log-probs).

    python3 bench/compare_generate.py --before b1.json b2.json --after a1.json a2.json --out compare.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def _rows(paths: list[str]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for path in paths:
        for row in json.loads(Path(path).read_text()):
            if row.get("method") == "ours":
                out.setdefault((row["variant"], row["batch"], row["new_tokens"]), []).append(row)
    return out


def compare(before: list[str], after: list[str], *, tolerance: float) -> dict:
    """Per row: both sides' tok/s (each run's and the median), the ratio, the digests and whether it passes."""
    old, new = _rows(before), _rows(after)
    if set(old) != set(new):
        raise ValueError(f"the runs have different rows: before {sorted(old)}, after {sorted(new)}")
    rows = []
    for key in sorted(old):
        b = [r["tok_s"] for r in old[key]]
        a = [r["tok_s"] for r in new[key]]
        digests = {d for r in old[key] + new[key] for d in r.get("digests", [r.get("digest")])}
        ratio = statistics.median(a) / statistics.median(b)
        rows.append({"variant": key[0], "batch": key[1], "new_tokens": key[2], "before_tok_s": b, "after_tok_s": a,
                     "ratio": ratio, "digests_equal": len(digests) == 1 and None not in digests,
                     "digest": sorted(d for d in digests if d)[:2],
                     "passes": ratio >= 1 - tolerance and len(digests) == 1 and None not in digests})
    return {"tolerance": tolerance, "before": before, "after": after, "rows": rows,
            "all_pass": all(r["passes"] for r in rows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", nargs="+", required=True, help="generate.py JSON files of the earlier commit")
    ap.add_argument("--after", nargs="+", required=True, help="generate.py JSON files of the later commit")
    ap.add_argument("--tolerance", type=float, default=0.03, help="largest allowed slowdown (default 0.03)")
    ap.add_argument("--out", default=None, help="also write the comparison here")
    args = ap.parse_args(argv)
    result = compare(args.before, args.after, tolerance=args.tolerance)
    for r in result["rows"]:
        print(f"{r['variant']:>20} B={r['batch']:<4} N={r['new_tokens']:<4} before {statistics.median(r['before_tok_s']):>9.0f}"
              f"  after {statistics.median(r['after_tok_s']):>9.0f}  ratio {r['ratio']:.3f}  digests "
              f"{'equal' if r['digests_equal'] else 'DIFFER'}  {'ok' if r['passes'] else 'FAIL'}")
    print("all pass" if result["all_pass"] else "NOT all pass")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["all_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

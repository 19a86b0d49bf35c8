"""Write or check the golden outputs (tests/golden_cases.py says what they are).

    PYTHONPATH=. python tests/golden/make_golden.py            # compare with the files; exit 1 on a difference
    PYTHONPATH=. python tests/golden/make_golden.py --write    # (re)write tests/golden/<this CPU>/*.json
    PYTHONPATH=. python tests/golden/make_golden.py --out DIR  # write this run's outputs to DIR (to diff two runs)
    PYTHONPATH=. python tests/golden/make_golden.py --probe    # greedy continuations without stops (to pick them)

Write them only on code whose numerics are the reference (issue 23: main before the restructuring).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests import golden_cases as golden  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite tests/golden/generation.json and recipe.json")
    parser.add_argument("--out", default=None, help="write this run's outputs to this directory instead")
    parser.add_argument("--probe", action="store_true", help="print greedy continuations without stop tokens")
    parser.add_argument("--only", choices=["generation", "recipe"], default=None)
    args = parser.parse_args()
    if args.probe:
        for name, case in golden.compute_generation(greedy_stops=[]).items():
            for dp, calls in case["results"].items():
                for tokens in calls["greedy"]["tokens"]:
                    print(name, dp, tokens)
        return 0
    outputs = {}
    if args.only in (None, "generation"):
        generation = golden.compute_generation()
        print("\n".join(golden.summary(generation)))
        problems = golden.exercised(generation)
        if problems:
            print("the generation cases do not exercise what they must:\n  " + "\n  ".join(problems))
            return 1
        outputs[golden.GENERATION_FILE] = {"inputs": golden.generation_inputs(), "outputs": generation}
    if args.only in (None, "recipe"):
        outputs[golden.RECIPE_FILE] = {"inputs": golden.recipe_inputs(), "outputs": golden.compute_recipe()}
    failed = False
    for path, value in outputs.items():
        if args.write or args.out:
            # --write: this kind of CPU's goldens (golden_cases.cpu_signature)
            target = os.path.join(golden.CPU_GOLDEN_DIR if args.write else args.out, os.path.basename(path))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            golden.write_atomically(target, golden.dumps({"environment": golden.environment(), **value}))
            print(f"wrote {target}")
            continue
        stored = golden.load(path)
        diff = golden.differences({k: stored.get(k) for k in value}, value)
        print(f"{os.path.basename(path)}: " + ("equal bit for bit" if not diff else "DIFFERS\n  " + "\n  ".join(diff)))
        failed |= bool(diff)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

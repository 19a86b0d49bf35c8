"""Write or check the golden outputs (tests/golden_cases.py says what they are and what a check compares).

    PYTHONPATH=. python tests/golden/make_golden.py               # the cross-CPU check of the committed files
    PYTHONPATH=. python tests/golden/make_golden.py --write       # rewrite tests/golden/*.json from this run
    PYTHONPATH=. python tests/golden/make_golden.py --out DIR     # this run's outputs (5 recipe steps) into DIR
    PYTHONPATH=. python tests/golden/make_golden.py --against DIR # this run against DIR's, bit for bit
    PYTHONPATH=. python tests/golden/make_golden.py --probe       # greedy continuations without stops (to pick them)

A restructuring that must not change numerics: ``--out DIR`` at the parent commit, then ``--against DIR`` at the
change, on the same machine (floats differ in the last bits between kinds of CPU). ``--write`` only on purpose, on
code whose numerics are the reference, saying why in the commit; it refuses cases with a near-tie decision.
Exit status: 1 when a check or comparison finds a difference.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests import golden_cases as golden  # noqa: E402


def compute(only, *, recipe_steps: int) -> dict[str, dict]:
    """This run's files, by base name: ``{"inputs": ..., "outputs": ...}``."""
    files = {}
    if only in (None, "generation"):
        generation = golden.compute_generation()
        print("\n".join(golden.summary(generation)))
        problems = golden.exercised(generation)
        if problems:
            raise SystemExit("the generation cases do not exercise what they must:\n  " + "\n  ".join(problems))
        files["generation.json"] = {"inputs": golden.generation_inputs(), "outputs": generation}
    if only in (None, "recipe"):
        inputs = dict(golden.recipe_inputs(), argv=["--train-iters", str(recipe_steps)])
        files["recipe.json"] = {"inputs": inputs, "outputs": golden.compute_recipe(recipe_steps)}
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite tests/golden/generation.json and recipe.json")
    mode.add_argument("--out", default=None, metavar="DIR", help="write this run's outputs to DIR")
    mode.add_argument("--against", default=None, metavar="DIR",
                      help="compare this run bit for bit with a --out DIR run of another commit on this machine")
    mode.add_argument("--probe", action="store_true", help="print greedy continuations without stop tokens")
    parser.add_argument("--only", choices=["generation", "recipe"], default=None)
    parser.add_argument("--recipe-steps", type=int, default=golden.RECIPE_STEPS,
                        help="recipe steps of --out / --against (default %(default)s; the golden file holds 1)")
    args = parser.parse_args()
    if args.probe:
        for name, case in golden.compute_generation(greedy_stops=[]).items():
            for dp, calls in case["results"].items():
                for tokens in calls["greedy"]["tokens"]:
                    print(name, dp, tokens)
        return 0
    if args.against is not None:
        missing = [f for f in ("generation.json", "recipe.json") if not os.path.exists(os.path.join(args.against, f))]
        if args.only is None and missing or args.only is not None and f"{args.only}.json" in missing:
            parser.error(f"--against {args.against}: no {', '.join(missing)} there (write it with --out first)")
    steps = 1 if args.write or not (args.out or args.against) else args.recipe_steps
    files = compute(args.only, recipe_steps=steps)
    failed = False
    for name, value in files.items():
        if args.write or args.out:
            target = os.path.join(golden.GOLDEN_DIR if args.write else args.out, name)
            if args.write:
                check = golden.check_generation if name == "generation.json" else golden.check_recipe
                problems = check(value["outputs"], value["outputs"])
                if problems:
                    print(f"{name}: not written:\n  " + "\n  ".join(problems))
                    failed = True
                    continue
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            golden.write_atomically(target, golden.dumps({"environment": golden.environment(), **value}))
            print(f"wrote {target}")
            continue
        if args.against is not None:
            stored = golden.load(os.path.join(args.against, name))
            diff = golden.differences({k: stored.get(k) for k in value}, value)
            verdict = "equal bit for bit"
        else:
            stored = golden.load(os.path.join(golden.GOLDEN_DIR, name))
            check = golden.check_generation if name == "generation.json" else golden.check_recipe
            diff = golden.differences(stored["inputs"], value["inputs"], "/inputs")
            diff += check(stored["outputs"], value["outputs"])
            verdict = "passes the cross-CPU check"
        print(f"{name}: " + (verdict if not diff else "DIFFERS\n  " + "\n  ".join(diff)))
        failed |= bool(diff)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

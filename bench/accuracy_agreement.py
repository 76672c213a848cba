"""kvc against kvpress in a `kvc eval --reference kvpress` result: per (task, length), how many
cells have equal accuracy, the largest difference, and how many answers are identical in text and
in verdict; then the settings whose answers differ. The table of docs/accuracy.md, "kvc against
kvpress".

Usage: python bench/accuracy_agreement.py [bench/results/accuracy/eval.json]
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(path: str = "bench/results/accuracy/eval.json") -> None:
    cells = json.load(open(path))["cells"]
    by_key = {(c["engine"], c["method"], c["budget"], c["task"], c["length"]): c for c in cells}
    groups: dict[tuple, list] = defaultdict(list)
    for (engine, method, budget, task, length), ours in by_key.items():
        theirs = by_key.get(("kvpress", method, budget, task, length))
        if engine == "kvc" and theirs is not None:
            groups[(task, length)].append((method, budget, ours, theirs))
    print("| task, length | cells with equal accuracy | largest difference | identical answers (text) | same verdict |")
    print("|---|---|---|---|---|")
    differing = []
    for (task, length), pairs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        equal = sum(a["correct"] == b["correct"] for _, _, a, b in pairs)
        largest = max(abs(a["accuracy"] - b["accuracy"]) for _, _, a, b in pairs) * 100
        same_text = same_verdict = total = 0
        for method, budget, a, b in pairs:
            theirs = {(i["case"], i["turn"]): i for i in b["items"]}
            texts = 0
            for item in a["items"]:
                other = theirs[(item["case"], item["turn"])]
                total += 1
                same_text += item["output"] == other["output"]
                same_verdict += item["correct"] == other["correct"]
                texts += item["output"] != other["output"]
            if texts:
                differing.append(f"{task} {length // 1024}K {method}@{budget}: {texts} answer(s) differ, "
                                 f"{a['correct']} against kvpress's {b['correct']} correct")
        print(f"| {task}, {length // 1024}K | {equal} of {len(pairs)} | {largest:.0f} points | "
              f"{same_text} of {total} | {same_verdict} of {total} |")
    print()
    for line in differing:
        print(f"- {line}")


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Held-out verdict accuracy of the vision-language judge that
``configs/tiny/vision_judge_sft.yaml`` trains, used through ``lightrft.rewards.GenerativeReward``
exactly as ``configs/tiny/vision_judge_grpo.yaml`` uses it.

    lightrft run sft --config tiny/vision_judge_sft     # writes outputs/tiny/vision_judge_sft/final
    python tests/benchmarks/vision_judge_eval.py [--judge DIR] [--n 200]

For each held-out board of ``outputs/tiny/shapes3/test.jsonl`` (boards no judge or actor trained
on), the conversation is built as the GRPO recipe builds it (a ``PromptDataset`` item and
``lightrft.data.prompts.conversation``: the board inline), and the judge rates every count of the
data set's range: the right one and each wrong one. Prints the
accuracy on right answers (verdict "yes"), on wrong ones ("no"), their mean (the balanced
verdict accuracy) and the parse failures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from lightrft.data import PromptDataset
from lightrft.data.prompts import conversation
from lightrft.models.multimodal import load_processor
from lightrft.rewards import GenerativeReward, Sample
from lightrft.tasks.shapes import SHAPES_JUDGE_TEMPLATE


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--judge", default="outputs/tiny/vision_judge_sft/final")
    ap.add_argument("--actor", default="outputs/tiny/vision_sft/final", help="its processor")
    ap.add_argument("--data", default="outputs/tiny/shapes3")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=12, help='"3 vs 3: yes" + EOS')
    args = ap.parse_args()
    made = json.loads((Path(args.data) / "meta.json").read_text())
    lo, hi = made["min_count"], made["max_count"]
    ds = PromptDataset(load_processor(args.actor), path=str(Path(args.data) / "test.jsonl"))
    items = [ds[i] for i in range(min(args.n, len(ds)))]
    judge = GenerativeReward(
        judge=args.judge,
        template=SHAPES_JUDGE_TEMPLATE,
        verdicts={"yes": 1.0, "no": 0.0},
        fallback=0.5,
        max_tokens=args.max_tokens,
    )
    chats, prompts, responses, right = [], [], [], []
    for it in items:
        chat = conversation(it["messages"], it["media"])
        for c in range(lo, hi + 1):
            chats.append(chat)
            prompts.append(it["prompt"])
            responses.append(str(c))
            right.append(str(c) == it["reference"])
    out = torch.as_tensor(judge(Sample.batch(prompts, responses, conversations=chats)))
    is_right = torch.tensor(right)
    acc_right = (out[is_right] == 1.0).float().mean().item()
    acc_wrong = (out[~is_right] == 0.0).float().mean().item()
    print(
        f"{len(items)} held-out boards, {len(responses)} verdicts: right answers judged right "
        f"{acc_right:.3f}, wrong answers judged wrong {acc_wrong:.3f}, balanced verdict accuracy "
        f"{(acc_right + acc_wrong) / 2:.3f}; parse failures {judge.parse_failures}",
        flush=True,
    )


if __name__ == "__main__":
    main()

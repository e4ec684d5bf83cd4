"""Where a reward model disagrees with the truth on a policy's own mistakes (the RLHF demo).

    python tests/benchmarks/rm_blind_spots.py outputs/tiny/add_sft/final outputs/tiny/rlhf_grpo/final

For each policy directory: its greedy answers on the held-out problems
(``outputs/tiny/add/test.jsonl``, raw-text prompts), its accuracy, its errors, in how many of
them the reward model (``--rm``, default ``outputs/tiny/rlhf_rm/final``, scored as the GRPO
config scores it: plain text) prefers the wrong greedy answer to the correct one, and the reward
model's mean score of the greedy answers and of the correct answers. A policy that earns more
reward than the correct answers would has found the reward model's blind spots.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def greedy_answers(path: str, prompts: list[str], max_tokens: int = 6) -> list[str]:
    from lightrft.models import load_model, load_tokenizer

    tok, model = load_tokenizer(path), load_model(path).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])  # [1, T]
        with torch.no_grad():
            gen = model.generate(
                ids,
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        out.append(tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("policies", nargs="+", help="HF directories of the policies to compare")
    parser.add_argument("--rm", default="outputs/tiny/rlhf_rm/final")
    parser.add_argument("--data", default="outputs/tiny/add/test.jsonl")
    args = parser.parse_args()

    from lightrft.rewards import RewardModel

    rm = RewardModel(args.rm, chat_template=False, micro_batch_size=512)
    records = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    prompts, answers = [r["prompt"] for r in records], [r["answer"] for r in records]
    correct_scores = rm(prompts, answers)  # [N]
    for path in args.policies:
        greedy = greedy_answers(path, prompts)
        scores = rm(prompts, greedy)  # [N]
        wrong = torch.tensor([g != a for g, a in zip(greedy, answers, strict=True)])
        preferred = int((scores[wrong] > correct_scores[wrong]).sum())
        print(
            f"{path}: accuracy {1 - wrong.float().mean():.3f}, errors {int(wrong.sum())}, "
            f"reward model prefers the error to the answer in {preferred}; mean score of the "
            f"greedy answers {scores.mean():.3f}, of the correct answers {correct_scores.mean():.3f}"
        )


if __name__ == "__main__":
    main()

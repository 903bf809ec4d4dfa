"""Best-of-n at evaluation: of n rollouts of a held-out problem, one is chosen WITHOUT the
reference answer and scored by the verifier.

Rules: `logprob` — the model's own confidence, the largest sum of the sample's committed tokens'
log-probs in its exact trace (under the distribution sampled; ties go to the earlier sample);
`vote` — majority vote over the completions' stripped text (the whole completion is the answer
the tasks' verifiers read), ties between answers going to the one with the most confident
sample. pass@n (any of the n correct: the oracle's choice) is the upper bound of every rule.
`nfe_per_problem` is the decoding's cost of all n samples (the sum of their NFE), to be set
beside the training and inference compute of a trained model.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

import numpy as np

RULES = ("logprob", "vote")


@dataclasses.dataclass(frozen=True)
class BestOfN:
    """Best-of-`n` by `rule` over the held-out problems: the chosen sample's accuracy (reward 1)
    and mean reward, pass@n (its upper bound), and the NFE of a problem's n samples, averaged.
    `correct` holds each problem's chosen-sample correctness, in `eval_examples` order."""

    n: int
    rule: str
    accuracy: float
    mean_reward: float
    pass_at_n: float
    nfe_per_problem: float
    correct: tuple[bool, ...] = dataclasses.field(default=(), repr=False)

    def metrics(self) -> dict[str, float]:
        """`best_of@<n>_<rule>` (accuracy) and `nfe_per_problem@<n>`, as the summary and W&B name them."""
        return {f"best_of@{self.n}_{self.rule}": self.accuracy, f"nfe_per_problem@{self.n}": self.nfe_per_problem}

    def to_dict(self) -> dict[str, float | int | str]:
        """Every field but the per-problem choices, JSON-ready."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "correct"}


def choose(texts: Sequence[Sequence[str]], logprobs: np.ndarray, rule: str) -> np.ndarray:
    """Per problem, the index of the sample `rule` picks among its n (`texts` `[problems][n]`,
    `logprobs` `[problems, n]`); neither reads a reference answer."""
    if rule not in RULES:
        raise ValueError(f"best-of-n rule: expected one of {RULES}, got {rule!r}")
    logprobs = np.asarray(logprobs, np.float64)
    if rule == "logprob":
        return np.argmax(logprobs, axis=1)
    chosen = []
    for row, scores in zip(texts, logprobs):
        answers = [t.strip() for t in row]
        counts = Counter(answers)
        top = max(counts.values())
        # among the most frequent answers, the sample with the highest log-prob (the first of equals)
        tied = [i for i, a in enumerate(answers) if counts[a] == top]
        chosen.append(max(tied, key=lambda i: (scores[i], -i)))
    return np.asarray(chosen, np.int64)


def best_of_n(rewards: np.ndarray, texts: Sequence[str], logprobs: np.ndarray, nfe: np.ndarray,
              rules: Sequence[str]) -> tuple[BestOfN, ...]:
    """Best-of-n for each rule from `[problems, n]` arrays of the samples' rewards, log-prob sums
    and NFE (and their texts, problem by problem: `problems * n` of them)."""
    rewards = np.asarray(rewards, np.float64)
    problems, n = rewards.shape
    grouped = [list(texts[i * n:(i + 1) * n]) for i in range(problems)]
    nfe_per_problem = float(np.mean(np.asarray(nfe, np.float64).reshape(problems, n).sum(axis=1)))
    pass_at_n = float(np.mean((rewards == 1.0).any(axis=1)))
    out = []
    for rule in rules:
        picked = np.take_along_axis(rewards, choose(grouped, logprobs, rule)[:, None], axis=1)[:, 0]
        out.append(BestOfN(n, rule, float(np.mean(picked == 1.0)), float(np.mean(picked)), pass_at_n,
                           nfe_per_problem, tuple(bool(c) for c in picked == 1.0)))
    return tuple(out)

"""Unbiased pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code").

Scores already-executed samples: per problem, ``n`` samples were generated and ``c`` of them
passed the unit tests. Execution lives elsewhere (``eval/sandbox.py``); this module never runs code.

Load it offline by directory path (the directory and the script share a name, which is what
``evaluate.load`` looks for)::

    metric = evaluate.load("eval/metrics/code_pass_at_k")   # or eval.humaneval_data.load_pass_at_k_metric()
    metric.compute(num_samples=[10, 10], num_correct=[3, 0], k=[1, 5])
    # {'pass@1': 0.15, 'pass@5': 0.458...}
"""
from __future__ import annotations

import datasets
import evaluate
import numpy as np

_CITATION = """\
@article{chen2021codex,
  title={Evaluating Large Language Models Trained on Code},
  author={Mark Chen and Jerry Tworek and Heewoo Jun and Qiming Yuan and Henrique Ponde de Oliveira Pinto
          and others},
  journal={arXiv preprint arXiv:2107.03374},
  year={2021}
}
"""

_DESCRIPTION = """\
Unbiased estimator of pass@k from per-problem sample counts: for a problem with n samples of which
c are correct, pass@k = 1 - C(n-c, k) / C(n, k), the probability that at least one of k samples
drawn without replacement from the n is correct. The result is averaged over problems.
"""

_KWARGS_DESCRIPTION = """
Args:
    num_samples (list of int): n, the number of samples generated for each problem.
    num_correct (list of int): c, how many of those samples passed, for each problem.
    k (list of int, default [1]): the k values to report; each must satisfy 1 <= k <= n for every problem.
Returns:
    dict mapping "pass@k" to the mean estimate over problems (float), one entry per k.
Examples:
    >>> metric = evaluate.load("eval/metrics/code_pass_at_k")
    >>> metric.compute(num_samples=[2, 2], num_correct=[1, 2], k=[1, 2])
    {'pass@1': 0.75, 'pass@2': 1.0}
"""


def estimate_pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k)/C(n, k), as the product form of the paper (no huge binomials, no overflow)."""
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def _validate(num_samples, num_correct, ks) -> None:
    if len(num_samples) != len(num_correct):
        raise ValueError(f"num_samples has {len(num_samples)} entries but num_correct has {len(num_correct)}")
    if not ks:
        raise ValueError("k must name at least one value")
    for i, (n, c) in enumerate(zip(num_samples, num_correct)):
        if n < 1 or not 0 <= c <= n:
            raise ValueError(f"problem {i}: need n >= 1 and 0 <= c <= n, got n={n}, c={c}")
        for k in ks:
            if not 1 <= k <= n:
                raise ValueError(f"problem {i}: k={k} is not in [1, n={n}]; pass@k needs at least k samples")


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class CodePassAtK(evaluate.Metric):
    """pass@k from (n, c) counts per problem."""

    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({
                "num_samples": datasets.Value("int64"),
                "num_correct": datasets.Value("int64"),
            }),
            reference_urls=["https://arxiv.org/abs/2107.03374"],
        )

    def _compute(self, num_samples, num_correct, k=(1,)):
        ks = [k] if isinstance(k, int) else list(k)
        num_samples, num_correct = [int(n) for n in num_samples], [int(c) for c in num_correct]
        _validate(num_samples, num_correct, ks)
        if not num_samples:
            raise ValueError("no problems to score")
        return {
            f"pass@{kk}": float(np.mean([estimate_pass_at_k(n, c, kk) for n, c in zip(num_samples, num_correct)]))
            for kk in ks
        }

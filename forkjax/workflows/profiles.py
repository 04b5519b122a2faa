"""Synthetic length profiles of the datasets ForkKV evaluates on: how many tokens a workflow's
shared context, per-agent instruction, generation and tool observation hold.

The benchmarks run random token ids (they measure the serving stack, not answers), so what they
need from a dataset is its shape. A profile gives four length distributions that a workflow draws
from with a seeded numpy Generator:

    context      the shared document / tool catalogue every agent reads first   [tokens]
    instruction  an agent's own question or cue, read last                       [tokens]
    gen          one generated turn (answer, thought + action, JSON call)        [tokens]
    obs          one tool observation appended after a ReAct turn                [tokens]

Each is a lognormal clipped to [lo, hi]. Where a dataset publishes (or its released data lets us
measure) both a mean and a median, the lognormal reproduces both: sigma = sqrt(2 ln(mean /
median)). Where only a mean is known, sigma is an assumption and says so.

Word counts become subword tokens at 24,005 / 19,367 = 1.24 tokens per word, the ratio of
LooGLE's average document length in tokens to that in words (Li et al. 2023, Table 1 "Statistics
of LooGLE", also assets/table.png of github.com/bigai-nlco/LooGLE).

Sources, per profile:

LooGLE, long-dependency QA (Li et al. 2023, "LooGLE: Can Long-Context Language Models Understand
Long Contexts?", arXiv:2311.04939, Table 1): 776 documents, 19,367 words / 24,005 tokens on
average; the long-dependency QA documents are Wikipedia pages (105 docs, 21,017 tokens on
average, 459 questions) and movie/TV scripts (155 docs, 36,412 tokens, 642 questions), so a
long-dependency question reads a document of 29,994 tokens on average (question-weighted). That
table gives no spread: sigma 0.4 is assumed (mean / e^0.4 = 20k and mean * e^0.4 = 45k bracket the
two categories' means). Questions, answers and evidence are measured on the 43 long-dependency QA
pairs released in LooGLE-testdata/longdep_qa.jsonl of the same repository: question 17.1 words
mean, 14 median; answer 15.9 mean, 12 median; evidence sentences ("S") 108 words mean, 97 median.
A ReAct observation is taken to be one such evidence retrieval. The generation cap of 500 tokens
is LooGLE's own (config/task2maxlen.json: longdep_qa 500).

NarrativeQA (Kočiský et al. 2018, "The NarrativeQA Reading Comprehension Challenge", TACL,
Table 1): summaries 659 tokens on average (train; max 1,161), questions 9.83 tokens, answers
4.73 tokens (word tokens). Stories, measured on documents.csv of github.com/google-deepmind/
narrativeqa (story_word_count of all 1,572 stories): 61,563 words mean, 33,982 median, 430,061
max (books 93,544 mean, scripts 29,824). The profile is the summaries setting of the paper: the
stories' median of ~42k tokens exceeds the contexts these benchmarks run, and LooGLE already
covers long documents. The spreads of summaries, questions and answers are assumptions (0.3, 0.35,
0.5), as is the observation (one retrieved ~200-word passage), which the paper does not define.

APIGen (Liu et al. 2024, "APIGen: Automated Pipeline for Generating Verifiable and Diverse
Function-Calling Datasets", arXiv:2406.18518; dataset card
https://huggingface.co/datasets/Salesforce/xlam-function-calling-60k): 60,000 entries over 3,673
executable APIs in 21 categories, each a `query`, the candidate `tools` (JSON descriptions) and the
`answers` (JSON list of calls; simple, multiple, parallel and parallel-multiple styles). Neither
the paper nor the card publishes lengths, so these are estimates from the card's example entry:
the query "Where can I find live giveaways for beta access and games?" (11 words, ~14 tokens),
one tool description of 269 characters (~67 tokens at 4 characters a token) and a two-call answer
of 134 characters (~34 tokens). The profile assumes ~3 candidate tools (200 tokens) as the shared
context, a 24-token query, a 40-token call, and a 64-token execution result as the observation
(APIGen executes every call in its verification; the result is what a ReAct agent reads back).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

TOKENS_PER_WORD = 24_005 / 19_367  # LooGLE Table 1: average document tokens / words


def words(n: float) -> int:
    """A word count as subword tokens."""
    return round(n * TOKENS_PER_WORD)


@dataclasses.dataclass(frozen=True)
class LengthDist:
    """Token counts: a lognormal of mean `mean` and log-std `sigma`, rounded and clipped to
    [lo, hi]. sigma 0 is the constant `mean`."""
    mean: int
    sigma: float = 0.0
    lo: int = 1
    hi: int | None = None  # None: no upper clip

    def __post_init__(self):
        if self.mean < 0 or self.sigma < 0 or self.lo < 0 or (self.hi is not None and self.hi < self.lo):
            raise ValueError(f"bad length distribution {self}")

    @classmethod
    def fixed(cls, n: int) -> "LengthDist":
        return cls(n, 0.0, n, n)

    @classmethod
    def from_mean_median(cls, mean: float, median: float, lo: int, hi: int | None) -> "LengthDist":
        """The lognormal with this mean and this median (mean >= median)."""
        return cls(round(mean), math.sqrt(2 * math.log(mean / median)), lo, hi)

    def sample(self, rng: np.random.Generator) -> int:
        if self.sigma == 0:
            x = float(self.mean)
        else:  # mu chosen so that the unclipped mean is `mean`
            x = rng.lognormal(math.log(max(self.mean, 1)) - self.sigma ** 2 / 2, self.sigma)
        return int(np.clip(round(x), self.lo, self.hi if self.hi is not None else np.inf))

    @property
    def upper(self) -> int:
        """The largest value `sample` can return (what the engine's max_model_len must hold)."""
        if self.hi is not None:
            return self.hi
        if self.sigma == 0:
            return max(self.mean, self.lo)
        raise ValueError(f"{self} has no upper bound")


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    context: LengthDist      # shared by every agent of a workflow, read first
    instruction: LengthDist  # one per agent, read last
    gen: LengthDist          # per generated turn
    obs: LengthDist          # per tool observation (ReAct)


def fixed_profile(context: int, gen: int, obs: int, instruction: int) -> Profile:
    """Every length given (the headline benchmark: --context 4096 --gen 64 --obs 64)."""
    for name, v, least in (("context", context, 1), ("gen", gen, 1), ("obs", obs, 0),
                           ("instruction", instruction, 0)):
        if not isinstance(v, int) or v < least:
            raise ValueError(f"--{name}={v!r}: expected an int >= {least}")
    return Profile("fixed", LengthDist.fixed(context), LengthDist.fixed(instruction),
                   LengthDist.fixed(gen), LengthDist.fixed(obs))


PROFILES: dict[str, Profile] = {
    "loogle": Profile(
        "loogle",
        context=LengthDist(29_994, 0.4, 4_096, 65_536),
        instruction=LengthDist.from_mean_median(words(17.1), words(14), 4, 128),
        gen=LengthDist.from_mean_median(words(15.9), words(12), 1, 500),
        obs=LengthDist.from_mean_median(words(108), words(97), 16, 512)),
    "narrativeqa": Profile(
        "narrativeqa",
        context=LengthDist(words(659), 0.3, 128, words(1_161)),
        instruction=LengthDist(words(9.83), 0.35, 3, 64),
        gen=LengthDist(words(4.73), 0.5, 1, 64),
        obs=LengthDist(words(200), 0.3, 32, 512)),
    "apigen": Profile(
        "apigen",
        context=LengthDist(200, 0.5, 32, 1_024),
        instruction=LengthDist(24, 0.5, 4, 128),
        gen=LengthDist(40, 0.5, 8, 256),
        obs=LengthDist(64, 0.7, 8, 256)),
}


def get_profile(name: str, **fixed) -> Profile:
    """`fixed` with its four lengths as keywords, or a dataset profile (no keywords)."""
    if name == "fixed":
        return fixed_profile(**fixed)
    if name not in PROFILES:
        raise ValueError(f"profile {name!r}: expected 'fixed' or one of {sorted(PROFILES)}")
    return PROFILES[name]

"""Adaptive speculation (`--method auto`): each round, speculate or not, whichever is expected
to give more tokens per second at the batch the engine is running.

A speculative round of R rows costs T_spec(R) and gives each sequence 1 + (its accepted drafts)
tokens; a plain round costs T_plain(R) and gives each one token. The engine has both rounds
compiled (`SpecConfig.plain_rounds`), times every round it runs, and counts per sequence the
drafts it accepted over its speculative rounds. It speculates when

    sum_i (1 + a_i) / T_spec(R)  >  n / T_plain(R)

over the n live sequences. Costs are measured, not assumed: they depend on the machine, the
batch bucket and greedy vs sampled rounds, so each (rows, speculate, greedy) keeps its recent
round times and uses their median (the engine's warm-up measures every kind first). Every
`explore_every`-th round takes the other choice, so both costs and the acceptance estimates
stay current when the workload changes (a sequence whose acceptance is only measured in
speculative rounds would otherwise never be tried again).

Both rounds are exact (greedy output is plain decoding's; sampling draws from the target's
distribution), but a sampled sequence's particular draws differ between them. So rounds that
hold a seeded sampled request always speculate: its text stays reproducible whatever else
shares its batch (`serve.engine`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass
class AdaptivePolicy:
    explore_every: int = 32  # every n-th round tries the choice that is not the best (about 3% of rounds)
    smoothing: float = 0.05  # weight of a new observation in the all-sequences running mean
    prior_weight: float = 4.0  # rounds' worth of the all-sequences mean in a sequence's estimate
    mean_accepted: float = 1.0  # running mean of accepted drafts per speculative round, all sequences
    window: int = 9  # recent round times per kind of round; their median is its cost
    samples: dict[tuple[int, bool, bool], deque] = dataclasses.field(default_factory=dict)
    rounds: int = 0
    # The engine thread observes rounds while the background warm-up times other buckets'.
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self):
        if self.explore_every < 2 or not 0 < self.smoothing <= 1 or self.prior_weight < 0:
            raise ValueError(f"need explore_every >= 2, smoothing in (0, 1] and prior_weight >= 0; got "
                             f"{self.explore_every}, {self.smoothing}, {self.prior_weight}")

    def expected_tokens(self, accepted: int, spec_rounds: int, draft_cap: int) -> float:
        """Tokens one speculative round is expected to give a sequence: 1 + its accepted drafts
        per round so far, shrunk toward all sequences' mean while it has had few rounds.

        The sequence's whole history, not a short running mean: acceptance comes in bursts
        (a line of code, then prose), and a short mean dips below the break-even after a few
        misses; in plain rounds it would then only be re-measured by exploration."""
        if draft_cap == 0:
            return 1.0
        w = self.prior_weight
        return 1.0 + min((accepted + w * self.mean_accepted) / (spec_rounds + w), draft_cap)

    def best(self, rows: int, greedy: bool, expected: Sequence[float]) -> bool:
        """Speculate? By the measured costs; True until speculating was measured, then False
        until plain rounds were (the first two rounds at each batch size measure both)."""
        spec, plain = self.cost(rows, True, greedy), self.cost(rows, False, greedy)
        if spec is None:
            return True
        if plain is None:
            return False
        return sum(expected) / spec > len(expected) / plain

    def choose(self, rows: int, greedy: bool, expected: Sequence[float]) -> bool:
        """This round's choice: the best one, except every `explore_every`-th round."""
        self.rounds += 1
        best = self.best(rows, greedy, expected)
        return (not best) if self.rounds % self.explore_every == 0 else best

    def observe_round(self, rows: int, speculate: bool, greedy: bool, seconds: float) -> None:
        with self._lock:
            self.samples.setdefault((rows, speculate, greedy), deque(maxlen=self.window)).append(seconds)

    def cost(self, rows: int, speculate: bool, greedy: bool) -> float | None:
        """Seconds per round of this kind: the median of the recent ones (a stray slow round,
        e.g. one that shared the CPU with a compile, does not move it); None if never run."""
        with self._lock:
            got = list(self.samples.get((rows, speculate, greedy), ()))
        return float(np.median(got)) if got else None

    def cost_table(self) -> dict[tuple[int, bool, bool], float]:
        with self._lock:
            kinds = list(self.samples)
        return {key: self.cost(*key) for key in kinds}

    def observe_acceptance(self, accepted: int) -> None:
        """One sequence's accepted drafts in a speculative round."""
        self.mean_accepted += self.smoothing * (accepted - self.mean_accepted)


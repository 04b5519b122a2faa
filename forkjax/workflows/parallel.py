"""Parallel rounds (multi-agent debate, parallel tool calls): every round all N agents answer the
same growing history at once, then each reads all the answers.

    prompt_{r,a}  = context + history_r + cue_a                    -> ans_{r,a} (gen_{r,a} tokens)
    history_0     = []
    history_{r+1} = history_r + (cue_a + ans_{r,a} for the agents a, in agent order)

Round r's N calls are submitted together when round r - 1 has finished (the next history reads
every answer, in agent order, not finish order). Where ReAct has one agent active at a time, here
all N read the shared prefix at once: under prefix caching the active working set is N copies of
it, under ForkKV one base and N residuals, so a host tier that keeps idle agents' copies cheaply
helps prefix caching less here than in ReAct.

Lengths [tokens]: context, the N cues and every call's generation length are drawn from the
profile at construction with the workflow's own Generator, so the shape depends only on the seed:

    final_tokens = context + sum_{r < R-1} sum_a (cue_a + gen_{r,a}) + max_a (cue_a + gen_{R-1,a})

There are no tool observations (the answers are what the next round reads).
"""

from __future__ import annotations

import numpy as np

from forkjax.workflows.base import TokenSampler, TurnRequest, Workflow, invoked
from forkjax.workflows.profiles import Profile


class ParallelWorkflow(Workflow):
    def __init__(self, index: int, agents, rounds: int, profile: Profile, tokens: TokenSampler,
                 rng: np.random.Generator, invocations: dict | None = None):
        """`invocations` {agent: token ids}: Activated LoRA agents (base.invoked)."""
        agents = tuple(agents)
        if not agents or len(set(agents)) != len(agents):
            raise ValueError(f"agents={agents!r}: expected distinct adapter names")
        if rounds < 1:
            raise ValueError(f"rounds={rounds!r}: expected >= 1")
        self.session_id = f"wf{index}"
        self.agents, self.rounds = agents, rounds
        self.num_turns, self.turns_done = len(agents) * rounds, 0
        self.context = tokens.draw(rng, profile.context.sample(rng))             # [context]
        invocations = invocations or {}
        self.cues = [invoked(tokens.draw(rng, profile.instruction.sample(rng)), invocations.get(a))
                     for a in agents]
        self.gens = [[profile.gen.sample(rng) for _ in agents] for _ in range(rounds)]  # [R][N]
        self.history: list[int] = []
        self._answers: list[list[int] | None] = []  # the round in flight's, by agent
        self._round = -1  # the round issued last

    @staticmethod
    def longest_request(profile: Profile, num_agents: int, rounds: int) -> int:
        """Prompt + generation tokens of the longest possible call (one of the last round)."""
        p = profile
        return (p.context.upper + (rounds - 1) * num_agents * (p.instruction.upper + p.gen.upper)
                + p.instruction.upper + p.gen.upper)

    @property
    def final_tokens(self) -> int:
        n, last = len(self.agents), self.rounds - 1
        rounds = sum(len(self.cues[a]) + self.gens[r][a] for r in range(last) for a in range(n))
        return len(self.context) + rounds + max(len(self.cues[a]) + self.gens[last][a] for a in range(n))

    def pop_ready(self, now: float) -> list[TurnRequest]:
        if self.done or any(a is None for a in self._answers):  # a round is in flight
            return []
        r = self._round = self._round + 1
        self._answers = [None] * len(self.agents)
        last = r == self.rounds - 1
        return [TurnRequest(self.session_id, r * len(self.agents) + i, a,
                            self.context + self.history + self.cues[i], self.gens[r][i],
                            () if last else tuple(x for x in self.agents if x != a), last)
                for i, a in enumerate(self.agents)]

    def complete(self, request: TurnRequest, output: list[int], now: float) -> None:
        r, i = divmod(request.turn, len(self.agents))
        if r != self._round or self._answers[i] is not None:
            raise ValueError(f"{self.session_id}: call {request.turn} completed twice or out of its round")
        self._answers[i] = list(output)
        self.turns_done += 1
        if all(a is not None for a in self._answers):
            self.history += [t for cue, ans in zip(self.cues, self._answers) for t in cue + ans]
            self._answers = []

    def next_ready_at(self) -> float | None:
        return None  # a round waits for the previous one's answers, never for a clock

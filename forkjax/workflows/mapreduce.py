"""MapReduce: M mappers read one shared document, then a reducer merges what they wrote.

    map_i   = document + instruction_i                              -> out_i   (gen_i tokens)
    reduce  = document + out_0 + ... + out_{M-1} + instruction_r    -> answer  (gen_r tokens)

Document first, instruction last, so all M + 1 agents (each its own adapter) share the document
prefix. The M map calls are submitted together at t=0; the reduce call becomes ready when the last
of them finishes and reads their outputs in mapper order (not finish order), so its prompt depends
only on the seed and the mappers' tokens.

Lengths [tokens]: document, the M + 1 instructions and the M + 1 generation lengths are drawn
from the profile once, at construction, with the workflow's own Generator. MapReduce has no tool
calls, so the profile's observation length is not used.
"""

from __future__ import annotations

import numpy as np

from forkjax.workflows.base import TokenSampler, TurnRequest, Workflow, invoked
from forkjax.workflows.profiles import Profile


class MapReduceWorkflow(Workflow):
    def __init__(self, index: int, mappers, reducer: str, profile: Profile, tokens: TokenSampler,
                 rng: np.random.Generator, invocations: dict | None = None):
        """`invocations` {agent: token ids}: Activated LoRA agents, each instruction opening with
        its agent's invocation (base.invoked)."""
        mappers = tuple(mappers)
        agents = mappers + (reducer,)
        if not mappers or len(set(agents)) != len(agents):
            raise ValueError(f"mappers={mappers!r}, reducer={reducer!r}: expected distinct adapter names")
        self.session_id = f"wf{index}"
        self.mappers, self.reducer, self.profile = mappers, reducer, profile
        self.agents, self.num_turns, self.turns_done = agents, len(agents), 0
        self.document = tokens.draw(rng, profile.context.sample(rng))            # [context]
        invocations = invocations or {}
        self.instructions = [invoked(tokens.draw(rng, profile.instruction.sample(rng)), invocations.get(a))
                             for a in agents]
        self.gens = [profile.gen.sample(rng) for _ in agents]
        self.outputs: list[list[int] | None] = [None] * len(mappers)            # [gen_i] each
        self._issued = 0  # calls handed out

    @staticmethod
    def longest_request(profile: Profile, num_mappers: int) -> int:
        """Prompt + generation tokens of the longest possible call (the reduce)."""
        p = profile
        return p.context.upper + (num_mappers + 1) * p.gen.upper + p.instruction.upper

    @property
    def final_tokens(self) -> int:
        """The reduce call's prompt and generation (or a map call's, were one longer)."""
        m, doc = len(self.mappers), len(self.document)
        maps = (doc + len(self.instructions[i]) + self.gens[i] for i in range(m))
        return max(doc + sum(self.gens[:m]) + len(self.instructions[m]) + self.gens[m], *maps)

    def pop_ready(self, now: float) -> list[TurnRequest]:
        m = len(self.mappers)
        if self._issued == 0:
            self._issued = m
            return [TurnRequest(self.session_id, i, a, self.document + self.instructions[i], self.gens[i],
                                tuple(x for x in self.agents if x != a))
                    for i, a in enumerate(self.mappers)]
        if self._issued == m and self.turns_done == m:
            self._issued += 1
            prompt = self.document + [t for out in self.outputs for t in out] + self.instructions[m]
            return [TurnRequest(self.session_id, m, self.reducer, prompt, self.gens[m], (), last=True)]
        return []

    def complete(self, request: TurnRequest, output: list[int], now: float) -> None:
        i = request.turn
        if i >= self._issued or (i < len(self.mappers) and self.outputs[i] is not None):
            raise ValueError(f"{self.session_id}: call {i} completed twice or before it was issued")
        if i < len(self.mappers):
            self.outputs[i] = list(output)
        self.turns_done += 1

    def next_ready_at(self) -> float | None:
        return None  # the reduce waits for the maps, never for a clock

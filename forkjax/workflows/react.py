"""ReAct: N agents take turns reasoning and acting over one shared context for R rounds.

A round is one turn of every agent, in order. Turn k (k = 0 .. N*R - 1) belongs to agent
a = agents[k % N] and reads

    prompt_k  = context + history_k + cue_a        # cue last: all agents share the longest prefix
    history_0 = []
    history_{k+1} = history_k + cue_a + gen_k + obs_k   # the transcript: who spoke, what, and
                                                        # obs_k, the tool's answer to the action

so turn k+1's prompt extends turn k's prompt and generation, and every agent forks the prefix the
previous agents built: under prefix caching each adapter recomputes and stores its own copy of
it, under ForkKV they share its base K/V (and with residual fan-out reuse the previous agent's
generation outright). Turn k generates
gen_k tokens; its tool observation (obs_k random tokens) arrives `tool_latency` seconds after it
finishes, and turn k+1 becomes ready then. The last turn's action needs no observation: the
workflow ends when its last generation does.

Lengths [tokens]: context, cue (one per agent), then gen_k for every turn and obs_k for every turn
but the last are drawn from the profile at construction with the workflow's own Generator, so a
workflow's shape depends only on its seed, never on timing or on what the model generated, and
its final length is known before it runs:

    final_tokens = context + sum_k (cue_{a_k} + gen_k) + sum_{k < last} obs_k

(the last turn's prompt and generation). The observation tokens are drawn with the same
Generator when each turn finishes, in turn order.

`invocations` {agent: token ids}: Activated LoRA agents, each cue opening with its agent's
invocation (base.invoked).

`tool_format="json"`: each turn's action is a JSON tool call (`TOOL_CALL_SCHEMA`) that the
engine's constrained decoding enforces, instead of free text: a turn then ends when its call's
JSON is complete, at most gen_k tokens, so the history grows by what the turns generated and
`final_tokens` is an upper bound.
"""

from __future__ import annotations

import numpy as np

from forkjax.workflows.base import TokenSampler, TurnRequest, Workflow, invoked
from forkjax.workflows.profiles import Profile

TOOL_FORMATS = ("text", "json")
# A ReAct action as a JSON tool call: a tool among a few and its input, bounded.
TOOL_CALL_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["tool", "input"],
                    "properties": {"tool": {"enum": ["search", "calculate", "lookup", "finish"]},
                                   "input": {"type": "string", "maxLength": 48}}}


class ReActWorkflow(Workflow):
    def __init__(self, index: int, agents, rounds: int, profile: Profile, tokens: TokenSampler,
                 rng: np.random.Generator, tool_latency: float = 0.0, tool_format: str = "text",
                 invocations: dict | None = None):
        agents = tuple(agents)
        if not agents or len(set(agents)) != len(agents):
            raise ValueError(f"agents={agents!r}: expected distinct adapter names")
        if rounds < 1:
            raise ValueError(f"rounds={rounds!r}: expected >= 1")
        if tool_latency < 0:
            raise ValueError(f"tool_latency={tool_latency!r}: expected seconds >= 0")
        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool_format={tool_format!r}: expected one of {TOOL_FORMATS}")
        self.guided_json = TOOL_CALL_SCHEMA if tool_format == "json" else None
        self.session_id = f"wf{index}"
        self.agents, self.num_turns, self.turns_done = agents, len(agents) * rounds, 0
        self.profile, self.tokens, self.rng, self.tool_latency = profile, tokens, rng, tool_latency
        self.context = tokens.draw(rng, profile.context.sample(rng))             # [context]
        invocations = invocations or {}
        self.cues = {a: invoked(tokens.draw(rng, profile.instruction.sample(rng)), invocations.get(a))
                     for a in agents}
        self.gens = [profile.gen.sample(rng) for _ in range(self.num_turns)]       # [num_turns]
        self.obs = [profile.obs.sample(rng) for _ in range(self.num_turns - 1)]    # [num_turns - 1]
        self.history: list[int] = []                                       # [sum(cue+gen+obs)]
        self._ready_at = 0.0
        self._in_flight = False

    @staticmethod
    def longest_request(profile: Profile, num_agents: int, rounds: int) -> int:
        """Prompt + generation tokens of the longest possible turn (the last one)."""
        p = profile
        return (p.context.upper + (num_agents * rounds - 1) * (p.instruction.upper + p.gen.upper
                                                               + p.obs.upper)
                + p.instruction.upper + p.gen.upper)

    @property
    def final_tokens(self) -> int:
        cues = sum(len(self.cues[self.agents[k % len(self.agents)]]) for k in range(self.num_turns))
        return len(self.context) + cues + sum(self.gens) + sum(self.obs)

    def pop_ready(self, now: float) -> list[TurnRequest]:
        if self.done or self._in_flight or now < self._ready_at:
            return []
        k = self.turns_done
        agent = self.agents[k % len(self.agents)]
        last = k == self.num_turns - 1
        self._in_flight = True
        return [TurnRequest(self.session_id, k, agent, self.context + self.history + self.cues[agent],
                            self.gens[k], () if last else tuple(a for a in self.agents if a != agent),
                            last, self.guided_json)]

    def complete(self, request: TurnRequest, output: list[int], now: float) -> None:
        if not self._in_flight or request.turn != self.turns_done:
            raise ValueError(f"{self.session_id}: turn {request.turn} completed out of order")
        self._in_flight = False
        self.turns_done += 1
        self.history += self.cues[request.adapter] + output
        if not self.done:
            self.history += self.tokens.draw(self.rng, self.obs[request.turn])
            self._ready_at = now + self.tool_latency

    def next_ready_at(self) -> float | None:
        return None if self.done or self._in_flight else self._ready_at

"""Several replicas behind a gateway, model-free: N `ReplayEngine`s (replay.py), each with a pool
of its own, and a router (routing.py) choosing a replica for every request, on one virtual clock.

`ReplicaSet` has the part of `ReplayEngine`'s API the in-process driver and bench_workflows use,
so a run drives it as it drives one engine. Its `clock` is the gateway's (the driver's) time;
each replica keeps a clock of its own, its host's, which runs ahead while its step runs. A step
of the set is the next event of a discrete-event simulation: every replica that is free and has
work launches its next step at max(its clock, now) (replay.ReplayEngine.launch), and the step
that ends first among those running finishes; the set's clock moves to its end, and its
requests reach the driver then. So replicas run in parallel in virtual time, each step taking
its replica's modelled cost, and a request a replica takes while its step runs waits for the
step's end, as in an engine. A request's host time (replay.HOST_S_PER_REQUEST) is its replica's.
"""

from __future__ import annotations

from collections.abc import Callable

from forkjax.engine.sequence import Sequence, Status
from forkjax.workflows.replay import IDLE_S, ReplayEngine, VirtualClock
from forkjax.workflows.routing import make_router

# Hit rates, recomputed from the summed counters they divide by the summed prompt tokens.
RATES = {"base_hit_rate": "base_hit_tokens", "residual_hit_rate": "residual_hit_tokens"}
PER_REPLICA = ("prompt_tokens", "base_hit_tokens", "residual_hit_tokens", "prefill_tokens_computed",
               "decode_batch_size_mean", "preemptions", "workflows_suspended")


class _Schedulers:
    """What the driver and the benchmark ask of `engine.scheduler`, over every replica."""

    def __init__(self, replica_set: "ReplicaSet"):
        self._set = replica_set

    @property
    def has_work(self) -> bool:
        return bool(self._set.flight) or any(r.scheduler.has_work for r in self._set.replicas)

    @property
    def max_batch_size(self) -> int:
        return self._set.replicas[0].scheduler.max_batch_size


class ReplicaSet:
    """`n` replicas built by `make_replica(i)` (a ReplayEngine each) behind the router `route`
    (routing.ROUTES); a request's routing key is its session id (the workflow's)."""

    def __init__(self, make_replica: Callable[[int], ReplayEngine], n: int, route: str = "hash"):
        if n < 1:
            raise ValueError(f"replicas={n}: expected >= 1")
        self.replicas = [make_replica(i) for i in range(n)]
        self.route, self.router = route, make_router(route, n)
        self.clock = VirtualClock()
        self.sleep = self.clock.sleep
        self.scheduler = _Schedulers(self)
        self.agents = self.replicas[0].agents
        self.flight: dict[int, tuple] = {}  # replica -> (its launched batch or None (a poll), end)
        self.where: dict[int, int] = {}  # seq id -> replica, until it finishes
        self.loads = [0] * n  # requests routed to each replica and not finished
        self._reset_counts()

    def _reset_counts(self):
        self.requests = [0] * len(self.replicas)
        self.busy_s = [0.0] * len(self.replicas)

    def add_request(self, prompt, adapter: str, params=None, **kw) -> Sequence:
        """Route the request (its `session_id` the key) and queue it on that replica."""
        i = self.router.route(kw.get("session_id") or "", prompt, self.loads)
        replica = self.replicas[i]
        replica.clock.t = max(replica.clock.t, self.clock.t)  # an idle replica waited until now
        seq = replica.add_request(prompt, adapter, params, **kw)
        self.where[seq.id] = i
        self.loads[i] += 1
        self.requests[i] += 1
        return seq

    def step(self) -> list[Sequence]:
        """The next step to end among the replicas' (module docstring): the requests it ran."""
        now = self.clock.t
        for i, replica in enumerate(self.replicas):
            if i in self.flight or not replica.scheduler.has_work:
                continue
            replica.clock.t = max(replica.clock.t, now)
            launched = replica.launch()
            if launched is None:  # nothing it can run yet: it polls again IDLE_S later
                self.flight[i] = (None, replica.clock.t)
                continue
            batch, dt = launched
            replica.clock.t += dt
            self.busy_s[i] += dt
            self.flight[i] = (batch, replica.clock.t)
        if not self.flight:
            self.clock.t += IDLE_S
            return []
        i = min(self.flight, key=lambda j: self.flight[j][1])
        batch, end = self.flight.pop(i)
        self.clock.t = max(self.clock.t, end)
        if batch is None:
            return []
        ran = self.replicas[i].finish(batch)
        for seq in ran:
            if seq.status is Status.FINISHED and self.where.pop(seq.id, None) is not None:
                self.loads[i] -= 1
        return ran

    def stats(self) -> dict:
        """The replicas' stats added up (loaded adapters and pool sizes too; the decode batch
        mean weighted by decode steps, hit rates over the summed prompt tokens), and
        `per_replica`: each one's PER_REPLICA counters, requests and busy seconds."""
        each = [r.stats() for r in self.replicas]
        out = {k: _add([s[k] for s in each]) for k in each[0]}
        steps = out["decode_steps"]
        out["decode_batch_size_mean"] = (sum(s["decode_batch_size_mean"] * s["decode_steps"] for s in each)
                                         / steps if steps else 0.0)
        for rate, counter in RATES.items():
            out[rate] = out[counter] / out["prompt_tokens"] if out["prompt_tokens"] else 0.0
        out["per_replica"] = [{**{k: s[k] for k in (*PER_REPLICA, *RATES)}, "requests": n, "busy_s": b}
                              for s, n, b in zip(each, self.requests, self.busy_s)]
        return out

    def reset_stats(self) -> dict:
        s = self.stats()
        for r in self.replicas:
            r.reset_stats()
        self._reset_counts()
        return s

    def flush_cache(self) -> int:
        """Every replica's cache flushed, and the router's memory of past requests with it."""
        self.router = make_router(self.route, len(self.replicas))
        return sum(r.flush_cache() for r in self.replicas)

    def describe(self) -> dict:
        return {**self.replicas[0].describe(), "replicas": len(self.replicas), "route": self.route}


def _add(values):
    """Numbers summed, dicts summed key by key, anything else the first's."""
    if isinstance(values[0], dict):
        return {k: _add([v.get(k, 0) for v in values]) for k in dict.fromkeys(k for v in values for k in v)}
    if isinstance(values[0], (int, float)) and not isinstance(values[0], bool):
        return sum(values)
    return values[0]

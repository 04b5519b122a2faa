"""A decode batch's inputs persist across steps (runtime/decode_rows.py): only the rows that
changed travel whole. Packed, they equal the inputs `build_inputs` writes from every row, under
random joins, leaves and page-table growth; and an engine updating them in place gives the same
float32 greedy and seeded-sampling outputs as one rebuilding every row every step, under random
arrivals and lengths, preemptions and adapter swaps."""

import numpy as np

import forkjax
from conftest import SMALL
from forkjax.engine import admission
from forkjax.engine.sequence import SamplingParams, Status
from forkjax.runtime.batch import PENDING, BatchRow, DecodeColumns, ScheduledBatch
from forkjax.runtime.decode_rows import DecodeRows
from forkjax.runtime.input_batch import InputLayout, build_inputs, sampling_arrays

S, WIDTH, SLOTS, CAPACITY = 4, 16, 4, 8


class _Request:
    """A decoding request as the scheduler would see it: pages granted as it grows."""

    def __init__(self, rid, rng, free):
        self.id, self.rng, self.free = rid, rng, free
        self.pos = int(rng.integers(0, 20))
        self.adapter = int(rng.integers(0, SLOTS))
        self.lora_start = -1 if rng.random() < 0.7 else int(rng.integers(0, self.pos + 1))
        self.residual = rng.random() < 0.7
        self.cached = self.pos + int(rng.random() < 0.3)  # its first position may be cached
        self.fan = {2: int(rng.integers(1, 64))} if rng.random() < 0.2 else {}
        self.params = SamplingParams(temperature=float(rng.random()), top_k=int(rng.integers(0, 9)),
                                     seed=int(rng.integers(0, 2**40)))
        self.base, self.res = [], []
        self.grow()

    def grow(self) -> bool:
        """Pages for the current position; True if the tables changed."""
        changed = False
        while len(self.base) <= self.pos // S:
            self.base.append(self.free.pop())
            self.res.append(self.free.pop() if self.residual else 0)
            changed = True
        return changed

    def slot(self, pages):
        page = pages[self.pos // S]
        return 0 if self.pos < self.cached or page == 0 else page * S + self.pos % S

    def row(self, prev_row, token):
        return BatchRow(self.pos, self.pos + 1, [token], prev_row, [self.slot(self.base)],
                        [self.slot(self.res)], {a: [s] for a, s in self.fan.items()},
                        np.asarray(self.base, np.int32), np.asarray(self.res, np.int32),
                        self.adapter, self.lora_start, self.params, self.pos)


def test_rows_kept_across_steps_pack_as_rows_rebuilt_every_step():
    rng = np.random.default_rng(0)
    free = list(rng.permutation(np.arange(1, 4000)))
    rows_kept, live, fresh, ids = DecodeRows(CAPACITY, WIDTH, S), [], set(), iter(range(10**6))
    for step in range(200):
        live = [r for r in live if rng.random() > 0.15 and r.pos < WIDTH * S - 1]  # leaves
        while len(live) < CAPACITY and rng.random() < 0.5:  # joins
            live.append(_Request(next(ids), rng, free))
        if not live:
            continue
        live.sort(key=lambda r: r.adapter)
        grown = {r.id for r in live if r.grow()}
        tokens = [PENDING if rng.random() < 0.8 else int(rng.integers(3, 99)) for _ in live]
        prev = [int(rng.integers(0, CAPACITY)) for _ in live]
        full = [r.row(p, t) for r, p, t in zip(live, prev, tokens)]
        sent = [row if r.id not in fresh or r.id in grown or r.fan or r.pos < r.cached else None
                for r, row in zip(live, full)]
        columns = DecodeColumns(np.asarray([r.id for r in live]), np.asarray([r.pos for r in live], np.int32),
                                np.asarray(tokens, np.int32), np.asarray(prev, np.int32),
                                np.asarray([r.pos for r in live], np.int32))
        batch = ScheduledBatch("decode", live, [(r.pos, r.pos + 1) for r in live], [], [],
                               rows=sent, decode=columns)
        pages = rows_kept.update(batch)
        assert pages == max(len(r.base) for r in live)
        layout = InputLayout(CAPACITY, 1, WIDTH, SLOTS, 1 if any(r.fan for r in live) else 0)
        got, sampling = rows_kept.build(batch, layout)
        want, want_sampling = build_inputs(ScheduledBatch("decode", live, batch.chunks, [], [], rows=full), layout)
        np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
        for a, b in zip(vars(sampling).values(), vars(sampling_arrays(full, CAPACITY)).values()):
            np.testing.assert_array_equal(a, b)
        assert vars(want_sampling).keys() == vars(sampling).keys()
        fresh = {r.id for r in live}
        for r in live:
            r.pos += 1
            r.cached = min(r.cached, r.pos)


def test_engine_with_rows_kept_gives_the_outputs_of_rows_rebuilt(monkeypatch):
    """Requests arrive a few a step with random lengths, some sampling with a seed, over five
    adapters in two device slots (swaps) in a pool a few requests outgrow (preemptions: admission
    counts one generated token, DECODE_CLIP=1)."""
    monkeypatch.setattr(admission, "DECODE_CLIP", 1)
    from test_engine_adapter_swap import ATTN, TINY
    from forkjax.models.builtin import random_adapter
    adapters = {f"a{i}": random_adapter(f"a{i}", TINY, 8, 16.0, ATTN, seed=i) for i in range(5)}
    rng = np.random.default_rng(1)
    jobs = [(rng.integers(3, 256, int(rng.integers(5, 30))).tolist(),
             [None, *adapters][int(rng.integers(0, 6))],
             SamplingParams(max_new_tokens=int(rng.integers(1, 60)), ignore_eos=True,
                            **(dict(temperature=0.8, seed=i) if i % 3 == 0 else {})))
            for i in range(24)]
    arrivals = np.sort(rng.integers(0, 30, len(jobs)))
    outputs, stats = [], []
    for persistent in (True, False):
        engine = forkjax.Engine.from_pretrained(
            "tiny-llama", adapters=adapters, dtype="float32", cache_policy="forkkv", max_loras=3,
            **dict(SMALL, kv_cache_bytes=10 * (32768 + 3 * 8192)))
        engine.scheduler.persistent_rows = persistent
        seqs, step = [], 0
        while len(seqs) < len(jobs) or any(s.status is not Status.FINISHED for s in seqs):
            while len(seqs) < len(jobs) and arrivals[len(seqs)] <= step:
                seqs.append(engine.add_request(*jobs[len(seqs)]))
            engine.step()
            step += 1
        assert all(s.error is None for s in seqs)
        outputs.append([s.output for s in seqs])
        stats.append(engine.stats())
    assert outputs[0] == outputs[1]
    assert [len(o) for o in outputs[0]] == [p.max_new_tokens for _, _, p in jobs]
    assert stats[0]["preemptions"] > 0 and stats[0]["lora_swaps"] > 0

"""What a step does to its requests on the host, when it is launched and when its outputs are
read: the scheduler's output processing (SGLang's `SchedulerOutputProcessorMixin`), in a file of
its own; the scheduler is the only writer of a request's state.

At launch the host advances every request as if the step had finished: its positions count as
computed and a request that samples has one more token, PENDING until the outputs arrive (with
overlap scheduling the next step is scheduled before that). When they arrive, a request whose step
computed a NaN or inf ends with an error and nothing of that step enters the trees; otherwise
prefill chunks are shared, score requests keep their logits (and hidden states), and sampled
tokens are appended, which may stop the request; a guided request's matcher consumes each, and
its next mask is built from the matcher before a step that samples for it is launched.
"""

from __future__ import annotations

import numpy as np

from forkjax.engine.guided import GuidedDecodingError, fill_masks
from forkjax.engine.sequence import NonFiniteError, Status
from forkjax.runtime.batch import ScheduledBatch


class SchedulerOutputProcessorMixin:
    """Methods of `Scheduler` (scheduler.py)."""

    def token_masks(self, batch: ScheduledBatch, width: int) -> np.ndarray:
        """[entries, width] int32 bitmasks of `batch`'s next tokens: a guided request's from
        its matcher (whose tokens are all known: engine_core.py takes in the step in flight
        first), all tokens allowed in the other rows."""
        masks = np.full((len(batch.seqs), width), -1, np.int32)
        # a request in pieces (a chunked prompt) samples at its last entry only
        last = {seq: i for i, seq in enumerate(batch.seqs)
                if seq.guide is not None and seq.status is Status.RUNNING}
        fill_masks([(seq.guide, i) for seq, i in last.items()], masks)
        return masks

    def on_launched(self, batch: ScheduledBatch) -> None:
        """Advance the host state as if the launched step had finished: its positions are
        computed and each request that samples has one more (PENDING) token."""
        batch.samples = []
        for i, (seq, (_, end)) in enumerate(zip(batch.seqs, batch.chunks)):
            seq.num_computed = end
            if seq.score or end < len(seq):
                continue  # a score request, or a prefill chunk short of the prompt's end
            seq.pending += 1
            seq.sample_row = i
            batch.samples.append(i)

    def process_outputs(self, batch: ScheduledBatch, out) -> None:
        """Take in the outputs of `batch`'s step (a model_runner.Fetched): check, cache, keep
        logits, append tokens, stop."""
        for i, (seq, (start, end)) in enumerate(zip(batch.seqs, batch.chunks)):
            if seq.status is not Status.RUNNING:
                continue
            if not out.finite[i]:  # before anything of this step enters the trees
                self.finish(seq, "error", NonFiniteError(
                    f"the model computed NaN or inf for positions {start}-{end - 1} of this request"
                    f" (adapter {seq.adapter!r}); from {start} on, nothing of it was cached"))
                continue
            bad = [slot for slot in seq.cache.fanout if not out.fan_finite[i, slot]]
            if bad:  # another agent's residuals of this request: never cached, it goes on
                self.drop_fanout(seq, bad)
            seq.num_verified = end
            if seq.score:
                seq.prompt_logits.append(out.logits[i])
                if seq.return_hidden:
                    seq.prompt_hidden.append(out.hidden[i])
                if end == len(seq):
                    self.finish(seq, "length")
        if batch.kind == "extend":  # share each chunk's whole pages with the requests in flight
            ends = {seq: end for seq, (_, end) in zip(batch.seqs, batch.chunks)}  # a request's last piece
            for seq, end in ends.items():
                self.chunk_done(seq, end)
        for i in batch.samples:
            seq = batch.seqs[i]
            if seq.status is not Status.RUNNING:
                continue  # aborted, or stopped one step earlier: this token is dropped
            seq.pending -= 1
            token = int(out.tokens[i])
            seq.output.append(token)
            p = seq.params
            if p.logprobs is not None:
                lp, ids, top = out.logprobs[i]
                seq.output_logprobs.append((lp, ids[:p.logprobs], top[:p.logprobs]))
            if seq.guide is not None:
                try:
                    seq.guide.advance(token)
                except GuidedDecodingError as e:
                    self.finish(seq, "error", e)
                    continue
                if seq.guide.done:  # the grammar is complete (its last token may be EOS)
                    self.finish(seq, "stop")
                    continue
            if token in p.stop_token_ids and len(seq.output) > p.min_tokens:
                self.finish(seq, "stop")
            elif (len(seq.output) >= p.max_new_tokens
                  or len(seq) - seq.pending >= self.max_model_len):
                self.finish(seq, "length")

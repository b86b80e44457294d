"""Per-token logging of an RL run to append-only Parquet: :class:`TokenLogger` and the no-op :class:`NullLogger`.

Usage in a GRPO-style trainer::

    from trustscope.logger import TokenLogger

    with TokenLogger("logs", run_id="dppo-0", config=asdict(cfg), model={"name": "Qwen2-tiny"},
                     sampling=engine.sampling_info(), tokenizer={"name": "char"}, vocab=vocab_texts,
                     loss_rule="dppo_binary_tv") as logger:
        for step in range(cfg.steps):
            ...
            logger.log_step(
                step,
                tokens={                                  # padded batch: arrays (B, T) / (B, T, K) + mask
                    "token_id": response_ids,             # (B, T) int
                    "mu_logprob": mu_logprob,             # (B, T)
                    "pi_logprob": pi_logprob,             # (B, T)  (detached; grads are ignored)
                    "old_logprob": old_logprob,           # (B, T)  optional
                    "advantage": advantages,              # (B, T) or (B,)
                    "entropy": entropy,                   # (B, T)  optional
                    "mu_topk_ids": mu_topk_ids,           # (B, T, K) optional
                    "mu_topk_logprobs": mu_topk_logprobs, # (B, T, K) optional
                    "pi_topk_logprobs": pi_topk_logprobs, # (B, T, K) optional
                    "kept": loss_out.keep,                # (B, T) bool, optional (default True)
                },
                mask=mask,                                # (B, T) bool: real response tokens
                samples={
                    "sample_id": sample_ids,              # (B,) int, unique within the step over all ranks
                    "prompt_id": prompt_ids,              # (B,) int
                    "prompt": prompts, "response": texts, # list[str] (optional)
                    "reward": rewards,                    # (B,) (optional)
                    "advantage": seq_advantages,          # (B,) (optional)
                    "finish_reason": finish_reasons,      # list[str] (optional)
                    # "length" is optional: mask.sum(1) is used, and a given one must agree with it
                },
                scalars={"loss": loss.item(), "reward/mean": r.mean(), "lr": lr},
            )

Arguments of :meth:`TokenLogger.log_step`:

- ``step`` (int, ``[0, 2**63)``): the training step. Steps never go backwards; the same step may be logged in
  several calls (micro-batches) as long as sample ids and scalar names do not repeat. After ``resume=True`` a step
  must be above every step already on disk for this rank.
- ``tokens`` (dict): columns of the ``tokens`` table (:data:`trustscope.runformat.layout.TOKENS`) as torch tensors, numpy
  arrays or lists. Padded form: ``(B, T)`` per-token columns, ``(B, T, K)`` top-K columns, ``(B,)`` per-sequence
  columns (``sample_id``, ``prompt_id``, ``advantage`` broadcast over T), with ``mask`` ``(B, T)``. Ragged form
  (``mask=None``, or a list of B 1-D bool masks of length ``T_i``): each per-token column is a list of B 1-D
  sequences of length ``T_i`` (top-K: ``(T_i, K)``).
  Required: ``token_id``, ``mu_logprob``, ``pi_logprob``, ``advantage`` (here or ``samples['advantage']``) and
  ``prompt_id`` (here or in ``samples``). ``sample_id`` may come from ``tokens`` or ``samples``; it must be unique
  within the step over all ranks (e.g. ``rank * B + i``). It defaults to ``rank * 2**32 + i``, ``i`` counting on
  over the micro-batches of the step, so ranks that pass none never collide. ``kept`` defaults to
  True. ``run_id``, ``step``, ``rank``, ``pos``, ``loss_rule`` are filled in by the logger. ``topk_tv`` /
  ``topk_kl`` are computed (:mod:`trustscope.divergence`, in the writer thread; for every token, as the summaries
  need them) when both top-K logprob lists are given and they are not. mu's top-K must already hold the sampled token
  (:func:`trustscope.divergence.force_sampled_into_topk`). Logprobs up to 1e-5 above 0 are stored as 0.
  Asynchronous and multi-turn runs add ``policy_version`` (the weight version that sampled each token, in
  ``[0, step]``) and ``turn`` (the model turn, never decreasing along a response), per token or ``(B,)`` per
  response; ``engine_token_id`` is the id the engine sampled where the trainer's input may differ. A run's own
  columns are declared once, ``TokenLogger(extra_columns={"env": "string"})``, and given like the built-in ones
  (:mod:`trustscope.columns` declares every column and its check).
- ``mask``: ``(B, T)`` bool, True on real response tokens (ragged form: one ``(T_i,)`` bool sequence a response,
  or None for all). ``pos`` is the column index (the index in the response).
- ``samples`` (dict): columns of the ``samples`` table, each of length B (row i describes tokens row i). May be
  given without ``tokens`` (then ``length`` is required); ``length`` defaults to the mask's row sums.
- ``scalars`` (dict[str, float]): written to the ``steps`` table (NaN and inf are kept). May be the only argument.
  Each name once per step and rank: a name repeated by a later micro-batch of the step is refused.
- ``loss_rule`` (str): overrides the logger's ``loss_rule`` for this call.

Bad input (NaN/inf or positive logprobs, top-K lists of the wrong length, lengths that disagree with the mask,
unknown columns, a step that goes backwards, integers that do not fit their column, text that is not valid UTF-8
such as a lone surrogate) raises :class:`trustscope.runformat.errors.SchemaError` naming the field and
the value; with ``strict=False`` it warns (:class:`LogWarning`) and drops the bad token rows (or the whole call when
the problem is not in a row). Nothing already written is touched.

``log_step`` copies the data (tensors go to CPU numpy), checks it and puts it on a bounded queue (routed-expert
lists, the one input too large to copy, are lent instead and guarded: ``copy_routing`` below); a background
thread turns it into Arrow and writes one file per table and flush: when a new step begins after ``flush_rows``
token rows are buffered or ``flush_seconds`` passed (so these flushes never split a step), when idle for
``flush_seconds``, on :meth:`flush` and on :meth:`close`. What waits in memory is bounded (``max_buffered_rows``
token rows, ``max_queue`` calls): when a call does not fit, ``log_step`` waits (``on_full="block"``, up to
``block_timeout_s``) or drops the call's trailing whole sequences (``on_full="drop"``), counted in the manifest's
``buffer`` key (:mod:`trustscope.logger.memory`). Errors of the writer thread (disk full, a read-only directory, ...) are raised as
:class:`LogDirError`, with the cause, by the next ``log_step``/``flush``/``close`` (strict) or warned about
(``strict=False``); a batch that cannot be written is lost alone (a file that cannot be written: its flush),
never the other buffered steps, and what was lost is counted in the manifest (``lost``). No call waits forever
on a writer thread that has died.

Constructor ``TokenLogger(logdir, run_id=None, *, config=None, model=None, sampling=None, tokenizer=None,
vocab=None, loss_rule="none", mu_source="engine", source=None, rank=None, resume=False, strict=True, token_fraction=1.0,
text_fraction=None, log_topk=True,
topk_precision="float32", flush_rows=1_000_000, flush_seconds=30.0, max_queue=8, max_buffered_rows=None,
on_full="block", block_timeout_s=60.0, seed=0, row_group_size=131072, fsync=True, write_threads=None, summaries=True, compact_every=10)``:

- ``run_id``: default ``<UTC time>-<random>``; ``rank``: default from ``torch.distributed`` (when initialised)
  or the ``RANK`` environment variable, else 0. Each rank writes its own files; rank 0 writes ``run.json`` and
  the vocab, other ranks ``ranks/rank<r>.json``.
- ``loss_rule``: the rule the trainer applied (a name from :func:`trustscope.losses.list_losses` or the
  framework's own, e.g. ``"trl:grpo"``); recorded in ``run.json`` and on every token row.
- ``mu_source``: where ``mu_logprob`` comes from: ``"engine"`` (the inference engine's log-probs),
  ``"trainer_recompute"`` (the framework kept none, so mu is the trainer's own recompute and mismatch reads ~0),
  or ``"imported"`` (read from another framework's dump). Recorded in ``run.json``.
- ``source``: which framework wrote the run, e.g. ``{"framework": "trl", "version": "1.16.0"}``; default
  trustscope itself. Recorded in ``run.json``.
- ``vocab``: token texts indexed by id (``list[str]``), or a ``dict[int, str]``, or a Hugging Face tokenizer.
- ``resume``: continue an existing run (new files only, nothing overwritten). Without it an existing run id is an
  error. :meth:`TokenLogger.cut_back` then drops what the rank logged after the step a framework resumes from.
  :meth:`TokenLogger.commit_step` commits a step on the writer thread without waiting (one logger for the run).
- ``token_fraction``: log the tokens of only this fraction of sequences (chosen by a hash of seed, step and
  sample_id, so every rank agrees); samples and scalars are always logged in full.
- ``text_fraction``: keep the prompt and response texts of only this fraction of samples (same hash; default
  None: ``token_fraction``'s, so the sampled responses' texts). ``samples`` may give ``prompt_token_ids`` /
  ``response_token_ids`` (a sequence of ids per sample) instead of texts; the writer thread decodes them with
  ``vocab``.
- ``log_topk=False``: leave the top-K list columns out (null); ``topk_tv`` / ``topk_kl`` are still computed.
- ``topk_precision="float16"``: round top-K logprobs to float16's 10-bit mantissa (still stored as float32, so the
  schema does not change), which makes them compress much better; ``topk_tv``/``topk_kl`` are computed before the
  rounding. The precision it costs is in ``docs/performance.md``.

- ``max_buffered_rows``: the token rows that may wait in memory, queued or in the open flush, until their flush
  is stored (default ``None``: 4 x ``flush_rows``, at least 4,000,000); ``max_queue``: the calls with data that may
  wait on the queue. ``on_full``: what a call that does not fit does, ``"block"`` (wait for room, up to
  ``block_timeout_s`` seconds, ``None`` for no limit, then drop) or ``"drop"`` (drop its trailing whole sequences,
  with a :class:`LogWarning`). All recorded in the manifest's ``logging``; see "Bounded memory" in
  ``docs/logging.md``.
- ``copy_routing=True``: copy routed-expert lists at the call. By default they are lent to the writer thread (no
  copy on the caller; :class:`trustscope.logger.experts.Lent`): a lent buffer the caller changes before the writer
  read it loses that call's routing columns, as the ``routing_buffer_changed`` incident, and routing is copied
  from then on. :func:`trustscope.logger.experts.handoff` hands over a buffer the caller will not touch again.
- ``write_threads``: how many files of the ``tokens`` table each flush encodes side by side, each on its own
  thread (default 2 where the process may use two cores, else 1); the row groups go to them in turn and the
  files are named ``...-f<flush>-p<part>.parquet``. The other tables are small and written as one file.
- ``compact_every``: after every ``compact_every`` commits a background thread merges that many consecutive
  units of one size class (flushes, or files it merged before) into one file per table, beside the writer, and
  commits the switch in the manifest (:mod:`trustscope.runformat.compaction`); a run flushed every step then holds a
  few files per rank instead of one per step, and readers' cost follows its rows. Files that are already large
  are left alone; the files a merge replaced are deleted by a later round at least a minute after it (readers
  that listed them just before still find them), or when the run is resumed. ``0`` turns it off (else at least
  2); ``trustscope compact`` does the same for logs already written.

Every call with tokens also yields exact per-step summaries over all its tokens, before ``token_fraction``
sampling (computed on the writer thread from the call's checked copy, then the sample is applied): blocked counts of every registered rule by advantage sign and mu bucket, mismatch moments and
histograms, top-K TV/KL histograms, bad-negative counts, entropy (:mod:`trustscope.logger.summaries`), written
to the ``summaries`` table in the same flushes as the other tables. They cost about as much CPU as encoding the
token rows (``docs/performance.md``); ``summaries=False`` leaves them out (recorded in the manifest's
``logging``), and then torch is imported only for tensors.

Files are ``<table>/r<rank>-s<first step>-<last step>-f<flush>.parquet``, row groups of ``row_group_size`` rows
(DuckDB's own row-group size is about the same), fsync'ed before the rename unless ``fsync=False``. A flush
becomes visible when the rank's manifest records its number as ``committed_flush``, together with the ``rows``,
``last_step``, ``tokens_generated`` (masked tokens handed in) and ``tokens_logged`` (token rows written after
``token_fraction`` sampling) it adds: readers (:func:`trustscope.runformat.commits.committed_files`) see a step in every
table or in none. One logger at a time writes a run's rank: a second one is refused while the first holds the
lock ``<run>/.r<rank>.lock`` (owner pid and host inside; the lock of a dead process is taken over).

What was sampled is written into the manifest (``logging`` key). The writer updates ``updated_at`` at least every
``flush_seconds``. :meth:`TokenLogger.close` (or leaving the ``with`` block) flushes and marks the run
``finished`` (``crashed``, with the error, if rows were lost); leaving it by an exception marks it ``crashed``; a
process that dies leaves ``running`` with a dead writer pid, which :func:`run_status` reads as ``crashed``, and a
writer that stopped updating reads ``stale``. :func:`run_summary` gives the Runs table's fields over all ranks.

With summaries on, the writer thread imports torch at the first call with tokens: the summaries (``summaries`` table,
:mod:`trustscope.logger.summaries`) run every registered rule's keep-mask, which are torch functions.
"""

from trustscope.logger.token_logger import MU_SOURCES, NullLogger, TokenLogger
from trustscope.logger.writer import round_mantissa
from trustscope.runformat.cutback import ResumeError, drop_steps_after
from trustscope.runformat.errors import LogDirError, LogWarning, SchemaError
from trustscope.runformat.runfiles import resolve_rank
from trustscope.runformat.status import effective_status, rank_statuses, run_status, run_summary

__all__ = ["MU_SOURCES", "LogDirError", "LogWarning", "NullLogger", "ResumeError", "SchemaError", "TokenLogger",
           "drop_steps_after", "effective_status", "rank_statuses", "resolve_rank", "round_mantissa", "run_status", "run_summary"]

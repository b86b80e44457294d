-- the page "where the mismatch lives" and the report: per run, summary dimension and bucket, over the steps
-- [$first_step, $last_step] (null: every step) taken together: tokens, mismatch mean, ess_frac from the merged
-- importance-weight sums, bad negative-update rate (the table macro dimension_mismatch), from the summaries'
-- dimension rows. $run_ids: the runs, or null for all. a run logged in full without them (an import) gets the same
-- rows from its token rows: mismatch_by_dimension_tokens, which trustscope.report_where.by_dimension runs for the
-- runs this one leaves out.
select * from dimension_mismatch('summary_dimensions', $run_ids, $first_step, $last_step)

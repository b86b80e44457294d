-- mismatch_by_dimension's rows from the token rows (token_dimensions), for the runs logged in full whose summaries
-- hold no dimension rows (imports, logs written before the dimensions). trustscope.report_where.by_dimension runs it
-- for the runs mismatch_by_dimension leaves out. $run_ids, $first_step, $last_step as there.
select * from dimension_mismatch('token_dimensions', $run_ids, $first_step, $last_step)

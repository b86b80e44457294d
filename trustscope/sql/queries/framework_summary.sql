-- per run: each framework figure of the framework_metrics view over the run's steps ($run_ids): its value at the
-- first and the last step, its mean and largest over the steps, the step where it is largest, and whether every
-- step's figure is exact (false: the logger kept a sample of the token rows). read by the report's frameworks
-- section.
with chosen as (
    select *
    from framework_metrics
    where list_contains($run_ids, run_id)
),

final as (
    select
        run_id,
        framework,
        metric,
        variant,
        count(*) as n_steps,
        min(step) as first_step,
        max(step) as last_step,
        arg_min(value, step) as first_value,
        arg_max(value, step) as last_value,
        avg(value) as mean_value,
        max(value) as max_value,
        arg_max(step, value) as max_step,
        bool_and(exact) as exact
    from chosen
    group by run_id, framework, metric, variant
    order by run_id, framework, metric, variant
)

select * from final

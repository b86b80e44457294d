-- every logged token with the indicators of the known causes of training-inference mismatch (trustscope explain):
-- null where the token lacks the column a cause needs (not measurable), else true when the cause touches it.
--   stale:       staleness > 0 (needs policy_version)
--   routing:     routing_agreement < 1 (needs routing_agreement)
--   drift:       the response's engine_token_id differs from token_id at this position or an earlier one (the
--                engine saw another history from the first differing id on; needs engine_token_id)
--   shift:       in the token's response turn, pi fits mu one position later or earlier: the shifted mean
--                |log pi - log mu| is below shift_factor times the logged one, itself at least shift_floor
--   temperature: over the response's top-k lists, log mu = a_t + s * log pi (a per-position normaliser a_t,
--                one slope s = 1 / T) fits with r^2 >= min_r2 and |log s| > log(1 + temperature_tolerance)
--   truncation:  over the same lists the slope is within that tolerance of 1 and log mu - log pi is a constant
--                offset above truncation_offset nats, larger than its spread inside a position: mu renormalised
--                over a truncated support (top-k / top-p), pi over the whole vocabulary (both need the top-k lists);
--                or the response's mu lists hold ids at the -inf stand-in (ids the engine's truncation left out,
--                which it could not sample) and log mu sits above log pi on the rest by more than its spread (and
--                1e-4 nats): then no slope is needed (a one-token nucleus has none) and a support too small for
--                the offset to reach truncation_offset (top-k of a confident model) is still seen
-- abs_log_ratio = |log pi - log mu|, k3 = (r - 1) - log r with r = pi / mu (the k3 estimator of kl(mu || pi)).
-- `run_ids`: the runs read, or null for all; `first_step` / `last_step`: the first and last step read, or null.
create or replace macro explain_tokens(run_ids, first_step, last_step, shift_factor, shift_floor, min_r2,
                                       temperature_tolerance, truncation_offset) as table
    with source as (
        select
            run_id, step, rank, sample_id, pos, coalesce(turn, 0) as segment, turn, staleness, advantage, kept,
            blocked_rules,
            mu_logprob::double as mu_lp,
            pi_logprob::double as pi_lp,
            routing_agreement, token_id, engine_token_id,
            mu_topk_logprobs::double[] as y_all,
            pi_topk_logprobs::double[] as x_all
        from tokens
        where (run_ids::varchar[] is null or list_contains(run_ids::varchar[], run_id))
            and (first_step::bigint is null or step >= first_step::bigint)
            and (last_step::bigint is null or step <= last_step::bigint)
    ),

    support as (
        -- the top-k entries inside mu's support: an entry at -50 nats or below is a -inf stand-in (an id the
        -- engine's truncation left out, which no engine samples), kept out of the fit and counted apart
        select
            * exclude (y_all, x_all),
            case when list_min(y_all) > -50 then y_all else
                list_transform(list_filter(range(1, len(y_all) + 1), lambda i: y_all[i] > -50), lambda i: y_all[i])
                end as y,
            case when list_min(y_all) > -50 then x_all else
                list_transform(list_filter(range(1, len(y_all) + 1), lambda i: y_all[i] > -50), lambda i: x_all[i])
                end as x,
            case when list_min(y_all) > -50 then 0 else len(list_filter(y_all, lambda v: v <= -50)) end as n_outside
        from source
    ),

    per_token as (
        select
            *,
            pi_lp - mu_lp as lr,
            abs(pi_lp - mu_lp) as abs_log_ratio,
            -- the top-k sums of one position: n, sum x, sum y, sum x^2, sum y^2, sum xy, the two masses
            len(y) as k,
            list_sum(x) as sx,
            list_sum(y) as sy,
            list_inner_product(x, x) as sxx,
            list_inner_product(y, y) as syy,
            list_inner_product(x, y) as sxy,
            list_sum(list_transform(y, lambda v: exp(v))) as mu_mass,
            list_sum(list_transform(x, lambda v: exp(v))) as pi_mass,
            -- the neighbours inside the response turn (one window: the only sort of the macro)
            lead(mu_lp) over seg as mu_next,
            lead(pos) over seg as pos_next,
            lag(mu_lp) over seg as mu_prev,
            lag(pos) over seg as pos_prev
        from support
        window seg as (partition by run_id, step, rank, sample_id, segment order by pos)
    ),

    centred as (
        select
            *,
            -- within-position (centred) sums: the per-position normaliser drops out
            sxx - sx * sx / k as cxx,
            syy - sy * sy / k as cyy,
            sxy - sx * sy / k as cxy,
            (syy - 2 * sxy + sxx) - (sy - sx) * (sy - sx) / k as cdd,
            case when pos_next = pos + 1 then abs(pi_lp - mu_next) end as abs_pi_earlier,
            case when pos_prev = pos - 1 then abs(pi_lp - mu_prev) end as abs_pi_later
        from per_token
    ),

    responses as (
        -- per response (grouped, then joined back: cheaper than a window per figure)
        select
            run_id, step, rank, sample_id,
            sum(cxy) / nullif(sum(cxx), 0) as fit_slope,
            sum(cxy) * sum(cxy) / nullif(sum(cxx) * sum(cyy), 0) as fit_r2,
            sum(sy - sx) / nullif(sum(k), 0) as fit_offset,
            sqrt(greatest(sum(cdd), 0) / nullif(sum(k - 1), 0)) as fit_spread,  -- null: one entry a position
            avg(mu_mass) as response_mu_mass,
            avg(pi_mass) as response_pi_mass,
            sum(n_outside) as response_outside,
            min(pos) filter (where engine_token_id is not null and engine_token_id != token_id) as first_drift_pos,
            count(engine_token_id) as n_engine_ids
        from centred
        group by all
    ),

    segments as (
        select
            run_id, step, rank, sample_id, segment,
            avg(abs_log_ratio) filter (where abs_pi_earlier is not null or abs_pi_later is not null) as shift_logged,
            avg(abs_pi_later) as shift_pi_later,
            avg(abs_pi_earlier) as shift_pi_earlier
        from centred
        group by all
    ),

    fits as (
        select c.*, r.* exclude (run_id, step, rank, sample_id), g.* exclude (run_id, step, rank, sample_id, segment)
        from centred as c
        join responses as r using (run_id, step, rank, sample_id)
        join segments as g using (run_id, step, rank, sample_id, segment)
    ),

    final as (
        select
            run_id, step, rank, sample_id, pos, turn, staleness, advantage, kept, blocked_rules, lr, abs_log_ratio,
            exp(lr) - 1 - lr as k3,
            staleness > 0 as stale,
            routing_agreement < 1 as routing,
            case when n_engine_ids > 0 then coalesce(pos >= first_drift_pos, false) end as drift,
            coalesce(shift_logged >= shift_floor
                     and least(shift_pi_later, shift_pi_earlier) < shift_factor * shift_logged, false) as shift,
            case when k is not null then coalesce(fit_r2 >= min_r2
                     and abs(ln(greatest(fit_slope, 1e-9))) > ln(1 + temperature_tolerance), false) end
                as temperature,
            case when k is not null then coalesce(
                     ((abs(ln(greatest(fit_slope, 1e-9))) <= ln(1 + temperature_tolerance)
                       and fit_offset > truncation_offset and fit_offset > fit_spread)
                      or (response_outside > 0 and fit_offset > greatest(coalesce(fit_spread, 0), 1e-4)))
                     and response_mu_mass > response_pi_mass, false) end as truncation,
            1 / fit_slope as fit_temperature, fit_r2, fit_offset, fit_spread, response_mu_mass, response_pi_mass,
            response_outside,
            shift_logged, shift_pi_later, shift_pi_earlier, first_drift_pos
        from fits
    )

    select * from final;

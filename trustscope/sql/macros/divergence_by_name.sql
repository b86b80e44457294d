-- the divergence a dppo rule gates on, picked by the rule's `divergence` parameter.
create or replace macro divergence_by_name(name, binary_tv, binary_kl, topk_tv, topk_kl) as
    case name
        when 'binary_tv' then binary_tv
        when 'binary_kl' then binary_kl
        when 'topk_tv' then topk_tv
        when 'topk_kl' then topk_kl
    end;

-- a default parameter of a registered loss rule, bound from trustscope.losses (get_loss(rule).defaults).
create or replace macro rule_param(rule, name) as
    struct_extract(struct_extract(getvariable('trustscope_params').rules, rule), name);

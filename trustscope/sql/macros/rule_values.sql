-- every rule's parameters as lists indexed by a token's rule_set (rule_blocks): rule_values()."<rule>"."<param>"
-- [rule_set]. bound from trustscope.db (the defaults or the caller's choice, and each run's own parameters).
create or replace macro rule_values() as
    getvariable('trustscope_params').rule_values;

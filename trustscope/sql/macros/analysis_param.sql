-- a parameter of the analysis views (bad-update delta, histogram bins), bound from trustscope.db.
create or replace macro analysis_param(name) as
    struct_extract(getvariable('trustscope_params').analysis, name);

"""``kvexport matrix``: export and check many model × target × dtype × max_cache_len rows, each in
its own child process, and report the results (markdown and JSON). Shards of one matrix run in
parallel CI jobs and their reports merge into one.

- ``spec``: the matrix file (TOML), its rows, and shards;
- ``row``: one row, run in a child process (export, check, a short run);
- ``runner``: runs a shard's rows and collects their results;
- ``report``: the report (JSON), merging shard reports, and its markdown;
- ``support_table``: the README's support table, generated from a report.
"""

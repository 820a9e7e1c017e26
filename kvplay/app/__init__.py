"""The application: what a run needs around the lab. checks (input validation), jobs (the one envelope every
command runs in: load, memory check, device, limit, cancel, progress), a module per view (compare, generate, memory,
capacity, throughput, quality, bench, inside, tradeoffs, advise: the functions the UI and the CLI call, named as
on every floor), startup, models, guard, settings, the catalogue, fetch and the prompts.
"""

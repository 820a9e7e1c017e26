"""The application: what a run needs around the lab. checks (input validation), jobs (the one envelope every
command runs in: load, memory check, device, limit, cancel, progress), commands (one function per feature,
which the UI and the CLI call), models, guard, settings, the catalogue, fetch and the prompts.
"""

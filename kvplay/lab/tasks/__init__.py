"""Synthetic long-context tasks generated from code and a seed (kvplay.lab.tasks.suite)."""

"""Presentation: tables, plots and explanations of what shardwise computes."""

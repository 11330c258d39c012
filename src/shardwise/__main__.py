"""`python -m shardwise …` is the `shardwise` command."""

from shardwise.cli import main

main()

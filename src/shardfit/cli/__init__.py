"""Command-line interface: `shardfit <command>` (cli.main), one module per command, and the torchrun launcher."""

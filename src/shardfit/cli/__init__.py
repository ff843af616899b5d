"""Command-line interface: `shardfit train` (doctor and plan come with their modules)."""

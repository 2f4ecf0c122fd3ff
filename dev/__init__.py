"""Development tools, not part of what a user runs: see dev/README.md."""

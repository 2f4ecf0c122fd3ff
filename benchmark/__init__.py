"""Memory and speed benchmark of the training scripts, side by side with SheepRL (see README.md)."""

"""One-off investigations: each answered one question, and its answer is committed under benchmark/results/."""

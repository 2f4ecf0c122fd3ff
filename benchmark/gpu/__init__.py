"""GPU-lease plumbing (gpu_lease.sh, the stages of `run.py --gpu-only --stage` that it runs, the note of its device
calls) and one-off investigations of the update's speed on a GPU; see benchmark/README.md, "Layout"."""

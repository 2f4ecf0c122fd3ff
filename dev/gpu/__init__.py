"""The GPU-lease plumbing (gpu_lease.sh, the stages it runs, the note of its device calls) and the tools that took a
GPU update apart (its profile, its operations by region, the report of a manual GPU session); see dev/README.md."""

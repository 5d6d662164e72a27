"""Data collection with the engine: self_distill (a target answers prompts, in-run or offline) and
jacobi_trajectories (Jacobi trajectories for CLLM training); shared splits one list of prompts over the ranks of a
launch through files, for both."""

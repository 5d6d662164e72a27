"""Benchmarks: run (`python -m inference bench`), methods (the runners), stats, suite (a plan of methods), prompt_sets,
greedy_ties (the fp64 tie judge), bandwidth, plots, peers (other engines), tree_fit (`build-tree`), engine_check.
Sits above the API (inference.api, inference.session); the CLI imports it, never the reverse."""

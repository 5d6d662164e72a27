"""The drafters that plug into the engine's Drafter protocol, and the registry that builds them from a name.

medusa, draft_model (+ draft_stop, its learned stopper), eagle3, jacobi, lookahead, prompt_lookup, path_trees
(per-step trees from token paths), spec (a parsed `--drafter` name), registry (name or checkpoint -> drafter).
Imports inference.engine and inference.kernels, never the API, bench or CLI.
"""

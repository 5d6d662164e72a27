"""The engine core: draft -> verify -> accept -> update cache.

tree (choice paths -> TreeBuffers, the shipped trees/), verify (greedy / typical / rejection sampling), cache (tree
masks and KV surgery), drafter (the Drafter protocol, Draft, DecodeState, NoDrafter), loop (generate), devices
(where a target split by device_map computes). Imports only inference.kernels.
"""

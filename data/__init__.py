"""Training data for drafters.

Modules: readers (files / hub ids -> conversations), templates (shipped Jinja chat templates), chat (conversation ->
input_ids + assistant-only labels), datasets (config -> encoded, optionally packed splits), collate (padding).
Import the module you need; this package imports nothing so that `import data.chat` stays light.
"""

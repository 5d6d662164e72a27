"""The longest draft a draft model may propose in one step: one owner for the engine (inference.drafters.draft_model)
and the training configs that bound a learned draft length (train.config's stopper `max_gamma`). Importable without
torch, so the Hydra schema loads without it."""

MAX_DRAFT_TOKENS = 32

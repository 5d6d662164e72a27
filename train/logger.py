"""The experiment logger: Trainer's report_to from `logger=`, wandb offline when it cannot run online."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from omegaconf import DictConfig

from data.extras import installed

log = logging.getLogger("draftsmith")


def configure_logger(cfg: DictConfig) -> list[str]:
    """Return Trainer's report_to; wandb runs offline when it cannot run online."""
    if cfg.logger.name == "none":
        return []
    if not installed("wandb"):  # the default logger on a core install (an explicit logger=wandb failed in check_extras)
        log.warning("logger=wandb: wandb is not installed, logging to the console only (pip install -e '.[wandb]')")
        return []
    os.environ.setdefault("WANDB_PROJECT", cfg.logger.project)
    if cfg.logger.entity:
        os.environ.setdefault("WANDB_ENTITY", cfg.logger.entity)
    os.environ.setdefault("WANDB_DIR", str(Path(cfg.output_dir).resolve()))
    if cfg.logger.mode:
        os.environ["WANDB_MODE"] = cfg.logger.mode
    elif "WANDB_MODE" not in os.environ and not _wandb_key_available():
        os.environ["WANDB_MODE"] = "offline"
        log.info("wandb: no API key found, logging offline to %s", os.environ["WANDB_DIR"])
    return ["wandb"]


def _wandb_key_available() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")

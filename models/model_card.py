"""The README.md of a drafter checkpoint: base model, method, data, steps, metrics and the command that made it,
from the checkpoint's config.json (models.checkpoint.write_checkpoint writes it beside config.json)."""

from __future__ import annotations

from typing import Any


def model_card(config: dict[str, Any]) -> str:
    training = config.get("training", {})
    lines = [
        f"# {config['drafter_type']} drafter for {config['base_model_name_or_path']}",
        "",
        f"Trained with [draftsmith](https://github.com/draftsmith/draftsmith) {config['draftsmith_version']}.",
        "",
        "| field | value |",
        "| --- | --- |",
    ]
    for key in ("base_model_name_or_path", "drafter_type", "num_heads", "num_layers", "head_format"):
        if key in config:
            lines.append(f"| {key} | {config[key]} |")
    if "backbone" in config:
        lines.append(f"| backbone | {config['backbone']['format']} ({config['backbone']['path']}/) |")
    for key in ("method", "data", "global_step"):
        if key in training:
            lines.append(f"| {key} | {training[key]} |")
    metrics = training.get("metrics", {})
    if metrics:
        lines += ["", "## Evaluation", "", "| metric | value |", "| --- | --- |"]
        lines += [f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in sorted(metrics.items())]
    if "command" in training:
        lines += ["", "## Reproduce", "", "```bash", training["command"], "```"]
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "from inference import load",
        "engine = load('<this directory>')",
        "```",
        "",
    ]
    return "\n".join(lines)

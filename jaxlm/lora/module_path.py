"""``--lora-modules`` entries: ``name=path`` or vLLM's JSON form ``{"name", "path", "base_model_name"}``."""

from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """One ``--lora-modules`` value; ValueError naming what is wrong."""
    text = str(text).strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {text!r} is not valid JSON: {e}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str):
            raise ValueError(f'--lora-modules {text!r}: the JSON form needs string "name" and "path"')
        unknown = set(obj) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(f"--lora-modules {text!r}: unknown key(s) {', '.join(sorted(unknown))}")
        base = obj.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules {text!r}: base_model_name must be a string")
        name, path = obj["name"], obj["path"]
    else:
        name, sep, path = text.partition("=")
        base = None
        if not sep:
            raise ValueError(f"--lora-modules {text!r}: expected name=path or a JSON object")
    if not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules {text!r}: the name and the path must not be empty")
    return LoRAModulePath(name.strip(), path.strip(), base)

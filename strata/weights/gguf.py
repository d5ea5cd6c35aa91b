"""Convert a llama.cpp GGUF checkpoint into a Hugging Face-style model directory.

The engine only loads Hugging Face layouts (`config.json` + `*.safetensors` + tokenizer files).
`convert_gguf_to_hf` turns a `.gguf` file into exactly that:

* every tensor is dequantized to float32 with `gguf.quants.dequantize` (the values written are
  the exact dequantized values, so the converted model computes what the GGUF encodes);
* llama.cpp tensor names are mapped back to HF names (`blk.3.attn_q.weight` ->
  `model.layers.3.self_attn.q_proj.weight`);
* for the `llama` architecture, the rotary row permutation that llama.cpp's `convert_hf_to_gguf.py`
  applies to `q_proj` / `k_proj` is undone (see `unpermute_rotary_rows`);
* for `gemma3`, the 1 that llama.cpp adds to every norm weight is taken off again (Gemma's RMSNorm
  scales by 1 + weight; transformers and our model add the 1 themselves), and the settings the file
  leaves to llama.cpp's runtime (the layer pattern, local RoPE base, score scale) are written out;
* the linear weights GGUF stores in a type with a native block format (Q4_0, Q4_1, Q4_K, Q5_0, Q8_0, Q6_K;
  see `strata.weights.gguf_blocks`) are also written, unchanged in value, as blocks into
  `blocks.safetensors` (`<name>.qs`, `<name>.d`, and `<name>.m` for q4), so the engine can run the
  model at the precision it ships in (`--quantization auto`, the default) or dequantized (`none`);
* `config.json`, `generation_config.json`, `model.safetensors`, `tokenizer.json` and
  `tokenizer_config.json` are written into a temporary sibling directory that is renamed onto
  `out_dir` only once complete, so an interrupted conversion never leaves a directory that looks valid.

Supported GGUF architectures: llama (also Mistral-style GGUFs, which llama.cpp labels `llama`),
qwen2, qwen3 and gemma3 (text) - the decoder families the engine implements that llama.cpp writes;
each family file declares its own (`FamilySpec.gguf`, `strata.models.spec.GGUFArch`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.numpy import save_file

from strata.models.spec import GGUFArch

logger = logging.getLogger(__name__)


def gguf_architectures() -> dict[str, GGUFArch]:
    """GGUF `general.architecture` -> how it converts: what each family file's `FamilySpec.gguf`
    declares (the q/k permutation, the norm offset, tensor names, tokenizer, settings the file leaves
    to llama.cpp's runtime). Importing the families imports torch: only a conversion calls this."""
    from strata.models import family_specs

    return {arch.name: arch for spec in family_specs() for arch in spec.gguf}


# Tensors outside the decoder layers.
GLOBAL_TENSOR_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# Tensors inside decoder layer N (`blk.N.<key>`), relative to `model.layers.N`.
LAYER_TENSOR_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",  # qwen3
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# config.json / generation_config.json field -> GGUF metadata key.
SPECIAL_TOKEN_IDS: dict[str, str] = {
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
}

_LAYER_TENSOR_RE = re.compile(
    r"blk\.(?P<layer>\d+)\.(?P<key>[a-z_]+)\.(?P<suffix>weight|bias)"
)
_GLOBAL_TENSOR_RE = re.compile(r"(?P<key>[a-z_]+)\.(?P<suffix>weight|bias)")

MODEL_FILE = "model.safetensors"
BLOCKS_FILE = "blocks.safetensors"

# (HF name, HF shape, thunk producing the float32 values): lets the writer stream one tensor at a time.
TensorSource = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]


class GGUFConversionError(ValueError):
    """The GGUF file uses something this converter cannot represent faithfully."""


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert `gguf_path` into a Hugging Face model directory at `out_dir` and return its path.

    `out_dir` must not exist yet (or be an empty directory). The result appears atomically: it is
    built in a hidden temporary sibling and renamed into place at the end. If another process
    creates `out_dir` first, `FileExistsError` is raised and our temporary copy is discarded.
    """
    gguf_path = Path(gguf_path).resolve()
    out_dir = Path(out_dir).absolute()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    _ensure_free(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    # A hidden, uniquely named sibling (same filesystem, so the final rename is atomic).
    # os.mkdir honours the umask, unlike tempfile.mkdtemp's 0700.
    tmp_dir = (
        out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    )
    tmp_dir.mkdir()
    try:
        reader = GGUFReader(gguf_path)
        arch = _architecture(reader)
        config = build_hf_config(reader)
        _write_json(tmp_dir / "config.json", config)
        _write_json(
            tmp_dir / "generation_config.json", _generation_config(reader, arch, config)
        )
        write_safetensors(tmp_dir / MODEL_FILE, _hf_tensors(reader, arch, config))
        write_blocks(tmp_dir / BLOCKS_FILE, reader, arch, config)
        if reader.get_field("tokenizer.ggml.model") is None:
            logger.warning(
                "%s has no tokenizer metadata; writing no tokenizer files", gguf_path
            )
        else:
            chat_template = _field(reader, "tokenizer.chat_template")
            _write_tokenizer(gguf_path, tmp_dir, config, chat_template)
        _publish(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def _ensure_free(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"refusing to overwrite existing {out_dir}")


def _publish(tmp_dir: Path, out_dir: Path) -> None:
    """Rename the finished directory into place (atomic on POSIX; replaces an empty dir only)."""
    try:
        os.replace(tmp_dir, out_dir)
    except OSError as exc:
        if out_dir.exists():
            raise FileExistsError(
                f"{out_dir} was created by someone else during conversion"
            ) from exc
        raise


# --------------------------------------------------------------------------------------------
# Metadata -> config.json
# --------------------------------------------------------------------------------------------


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _architecture(reader: GGUFReader) -> str:
    arch = _field(reader, "general.architecture")
    archs = gguf_architectures()
    if arch not in archs:
        supported = ", ".join(sorted(archs))
        raise GGUFConversionError(
            f"GGUF architecture {arch!r} is not supported (supported: {supported})"
        )
    return arch


def _f32(value: float) -> float:
    """A float stored as float32 in GGUF, as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _single_int(value: Any, key: str) -> int:
    """Head counts may be per-layer arrays in GGUF; we only support a uniform value."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise GGUFConversionError(
                f"{key} varies per layer ({value}); not supported"
            )
        value = value[0]
    return int(value)


def build_hf_config(reader: GGUFReader) -> dict[str, Any]:
    """The HF `config.json` contents described by the GGUF metadata and tensor list."""
    arch = _architecture(reader)
    spec = gguf_architectures()[arch]

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFConversionError("GGUF has no token_embd.weight tensor")
    hidden = int(meta("embedding_length"))
    num_heads = _single_int(meta("attention.head_count"), "attention.head_count")
    num_kv_heads = _single_int(
        meta("attention.head_count_kv", num_heads), "attention.head_count_kv"
    )
    head_dim = int(
        meta("attention.key_length")
        or meta("rope.dimension_count")
        or hidden // num_heads
    )
    rope_theta = _f32(meta("rope.freq_base", 10000.0))

    config: dict[str, Any] = {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        # Embedding rows are the real vocabulary size (`{arch}.vocab_size` is optional metadata).
        "vocab_size": _hf_shape(tensors["token_embd.weight"])[0],
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta("context_length", 2048)),
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        # transformers 5 reads `rope_parameters`; older readers read `rope_theta` / `rope_scaling`.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": False,
        # llama.cpp omits `output.weight` when lm_head shares the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    _apply_rope_scaling(config, arch, meta, tensors)
    if spec.config is not None:
        try:
            spec.config(config, meta)
        except GGUFConversionError:
            raise
        except ValueError as exc:
            raise GGUFConversionError(str(exc)) from exc
    for name, key in SPECIAL_TOKEN_IDS.items():
        token_id = _field(reader, key)
        if token_id is not None:
            config[name] = int(token_id)
    return config


def _apply_rope_scaling(
    config: dict[str, Any], arch: str, meta: Any, tensors: dict[str, ReaderTensor]
) -> None:
    if "rope_freqs.weight" in tensors:
        # Llama 3.x stores its frequency-dependent scaling as a tensor, not as parameters.
        raise GGUFConversionError(
            "llama3-style rope scaling (rope_freqs tensor) is not supported"
        )
    scaling_type = meta("rope.scaling.type", "none")
    if scaling_type in ("none", None):
        return
    if scaling_type != "linear":
        raise GGUFConversionError(
            f"{arch}.rope.scaling.type={scaling_type!r} is not supported"
        )
    factor = _f32(meta("rope.scaling.factor"))
    config["rope_parameters"] = {
        **config["rope_parameters"],
        "rope_type": "linear",
        "factor": factor,
    }
    config["rope_scaling"] = {"rope_type": "linear", "factor": factor}


def _generation_config(
    reader: GGUFReader, arch: str, config: dict[str, Any]
) -> dict[str, Any]:
    generation = {k: config[k] for k in SPECIAL_TOKEN_IDS if k in config}
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    ends = gguf_architectures()[arch].end_of_turn_tokens
    extra = [tokens.index(t) for t in ends if t in tokens]
    if "eos_token_id" in generation and extra:
        generation["eos_token_id"] = [generation["eos_token_id"], *extra]
    return generation


# --------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """Map a llama.cpp tensor name to its Hugging Face name; `GGUFConversionError` if unknown."""
    if m := _LAYER_TENSOR_RE.fullmatch(gguf_name):
        spec = gguf_architectures().get(arch)
        names = {**LAYER_TENSOR_NAMES, **(spec.layer_tensor_names if spec else {})}
        if m["key"] in names:
            return f"model.layers.{m['layer']}.{names[m['key']]}.{m['suffix']}"
    elif m := _GLOBAL_TENSOR_RE.fullmatch(gguf_name):  # noqa: SIM102 - as the branch above
        if m["key"] in GLOBAL_TENSOR_NAMES:
            return f"{GLOBAL_TENSOR_NAMES[m['key']]}.{m['suffix']}"
    raise GGUFConversionError(
        f"unknown GGUF tensor {gguf_name!r}; cannot map it to a Hugging Face name"
    )


def unpermute_rotary_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (`LlamaModel.permute` in convert_hf_to_gguf.py).

    HF stores each head's rows in "rotate_half" order: rotary pair i is (row i, row i + d/2), d the
    head dim. ggml's rope rotates adjacent rows (2i, 2i + 1), so llama.cpp reorders the rows of
    every head with `reshape(n_head, 2, d/2, ...).swapaxes(1, 2)`, i.e.

        gguf row  h*d + 2*i + half  <-  hf row  h*d + half*(d/2) + i      (half in {0, 1}, i < d/2)

    The inverse reads the GGUF rows as (n_head, d/2, 2) and swaps the last two axes back to
    (n_head, 2, d/2). Works for 2-D weights and 1-D biases. `n_head` is the number of heads the
    tensor holds: num_attention_heads for q, num_key_value_heads for k.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise GGUFConversionError(f"cannot un-permute {rows} rows over {n_head} heads")
    half_dim = rows // n_head // 2
    return (
        weight.reshape(n_head, half_dim, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _hf_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-varying first (ne0 = row length); numpy/torch list them last.
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


def dequantize_tensor(tensor: ReaderTensor) -> np.ndarray:
    """The tensor's values as a float32 array in HF (row-major) shape."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    try:
        values = dequantize(tensor.data, qtype)
    except NotImplementedError as exc:
        raise GGUFConversionError(
            f"tensor {tensor.name!r} has type {qtype.name}, which gguf.quants cannot dequantize"
        ) from exc
    # F32 comes back as a view of the memory map; always hand out an owned float32 copy.
    return np.array(values, dtype=np.float32).reshape(_hf_shape(tensor))


def permuted_heads(gguf_name: str, arch: str, config: dict[str, Any]) -> int | None:
    """The head count to un-permute a tensor's rows over (see `unpermute_rotary_rows`), or None
    for tensors llama.cpp stores unpermuted."""
    if not gguf_architectures()[arch].permuted_qk:
        return None
    heads = {
        "attn_q": config["num_attention_heads"],
        "attn_k": config["num_key_value_heads"],
    }
    return heads.get(gguf_name.split(".")[-2])


def _hf_tensors(
    reader: GGUFReader, arch: str, config: dict[str, Any]
) -> Iterable[TensorSource]:
    """A `TensorSource` for every tensor of the GGUF, in file order."""
    seen: set[str] = set()
    norm_offset = gguf_architectures()[arch].norm_offset
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, arch)
        if name in seen:
            raise GGUFConversionError(f"duplicate tensor {name}")
        seen.add(name)
        n_head = permuted_heads(tensor.name, arch, config)
        offset = 1.0 if norm_offset and name.endswith("norm.weight") else 0.0

        def load(
            tensor: ReaderTensor = tensor,
            n_head: int | None = n_head,
            offset: float = offset,
        ) -> np.ndarray:
            values = dequantize_tensor(tensor)
            if offset:  # exact where llama.cpp's +1 was (bf16 weights), so 1 + weight is the stored value
                values -= np.float32(offset)
            return values if n_head is None else unpermute_rotary_rows(values, n_head)

        yield name, _hf_shape(tensor), load


def write_safetensors(path: Path, tensors: Iterable[TensorSource]) -> None:
    """Dequantize every tensor and write them as one float32 .safetensors file."""
    arrays: dict[str, np.ndarray] = {}
    for name, shape, load in tensors:
        values = np.ascontiguousarray(load(), dtype=np.float32)
        if values.shape != tuple(shape):
            raise GGUFConversionError(
                f"{name}: got shape {values.shape}, expected {tuple(shape)}"
            )
        arrays[name] = values
    save_file(arrays, str(path), metadata={"format": "pt"})


def write_blocks(
    path: Path, reader: GGUFReader, arch: str, config: dict[str, Any]
) -> int:
    """Write the 2-D tensors that have a native block format as blocks; returns how many (none: no file)."""
    from strata.weights.gguf_blocks import to_blocks

    arrays: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        shape = _hf_shape(tensor)
        if len(shape) != 2 or not tensor.name.endswith(".weight"):
            continue
        blocks = to_blocks(
            tensor.data, GGMLQuantizationType(tensor.tensor_type), *shape
        )
        if blocks is None:
            continue
        n_head = permuted_heads(tensor.name, arch, config)
        name = hf_tensor_name(tensor.name, arch)
        for part, values in blocks.items():  # rows permute alike in every part
            arrays[f"{name}.{part}"] = np.ascontiguousarray(
                values if n_head is None else unpermute_rotary_rows(values, n_head)
            )
    if arrays:
        save_file(arrays, str(path), metadata={"format": "pt"})
    return len(arrays)


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def _write_tokenizer(
    gguf_path: Path, out_dir: Path, config: dict[str, Any], chat_template: str | None
) -> None:
    """tokenizer.json + tokenizer_config.json via transformers' GGUF tokenizer conversion (which
    rebuilds SentencePiece vocabularies such as Gemma's as well as GPT-2-style BPE ones)."""
    from transformers import AutoTokenizer  # heavy import, only needed here

    model_type = config["model_type"]
    named_types = {
        a.model_type for a in gguf_architectures().values() if a.named_tokenizer
    }
    named = {"tokenizer_type": model_type} if model_type in named_types else {}
    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, **named
    )
    tokenizer.save_pretrained(str(out_dir))

    # Make tokenizer_config.json self-describing for readers that do not look at
    # chat_template.jinja (transformers 5 writes the template there).
    cfg_path = out_dir / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    if chat_template:
        tok_cfg["chat_template"] = chat_template
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = getattr(tokenizer, name, None)
        if token is not None:
            tok_cfg[name] = str(token)
    tok_cfg["model_max_length"] = config["max_position_embeddings"]
    tok_cfg.pop("is_local", None)
    tok_cfg.pop("local_files_only", None)
    _write_json(cfg_path, tok_cfg)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")

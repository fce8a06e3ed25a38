"""Import a Hugging Face model directory (`model.init_from = "hf:PATH"`), as `save_pretrained` writes
it: a Llama, Qwen2/Qwen2.5, Qwen3, Qwen3-MoE or DeepSeek-V3 (`model/families.py` says which by
config.json's architecture).

- `model_config_from_hf`: `config.json` -> a complete ModelConfig named "from_hf", or a one-line
  error naming what trainbook cannot run (another architecture, scaled RoPE, an o_proj bias, ...);
- `check_against_recipe`: that config against a recipe's named model, field by field;
- `load_hf_weights`: `model.safetensors` or an index and its shards -> a built model's parameters,
  one tensor at a time (see there for the memory this costs); never unpickles anything;
(The directory's tokenizer is read by `data/tokenizer/hf_dir.py`.)
Names map through the table in `model/hf.py`; a stacked expert weight is read row by row, one
file tensor per expert (`model.hf.expert_names`).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pydantic import ValidationError
from safetensors import safe_open

from trainbook.config.model import ModelConfig
from trainbook.errors import TrainbookError, one_line
from trainbook.model import families
from trainbook.model.hf import expert_names, to_hf_name
from trainbook.model.registry import FROM_HF, MLA_FIELDS, MOE_FIELDS, is_resolved, resolve

if TYPE_CHECKING:
    from trainbook.model.llama import Llama

# ---- config.json -> ModelConfig ---------------------------------------------------------

CONFIG_FILE = "config.json"

# ModelConfig field -> (config.json key, the default transformers gives a key left out, or None
# where trainbook requires the key). n_kv_heads, head_dim and rope_theta are read apart.
_FROM_CONFIG = {
    "dim": ("hidden_size", None),
    "n_layers": ("num_hidden_layers", None),
    "n_heads": ("num_attention_heads", None),
    "vocab_size": ("vocab_size", None),
    "ffn_dim": ("intermediate_size", None),
    "norm_eps": ("rms_norm_eps", 1e-6),
    "tie_embeddings": ("tie_word_embeddings", False),
    "init_std": ("initializer_range", 0.02),
}
_HF_KEY = {f: key for f, (key, _) in _FROM_CONFIG.items()} | {
    "n_kv_heads": "num_key_value_heads", "rope_theta": "rope_theta", "head_dim": "head_dim",
    "max_seq_len": "max_position_embeddings", "family": "architectures", "qkv_bias": "architectures",
    "qk_norm": "architectures", "n_experts": "num_experts", "n_experts_per_token": "num_experts_per_tok",
    "expert_ffn_dim": "moe_intermediate_size", "router_norm_topk": "norm_topk_prob",
    "dense_layers": "mlp_only_layers", "n_shared_experts": "architectures", "router_score": "architectures",
    "router_bias": "architectures", "router_groups": "architectures", "router_topk_groups": "architectures",
    "router_scale": "architectures", "kv_lora_rank": "kv_lora_rank", "q_lora_rank": "q_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
}  # fmt: skip


def hf_path(init_from: str) -> Path:
    """The directory of `model.init_from = "hf:PATH"`."""
    kind, _, path = init_from.partition(":")
    if kind != "hf" or not path:
        raise TrainbookError(f"{init_from!r} is not hf:PATH (a Hugging Face model directory)", where="model.init_from")
    if not Path(path).is_dir():
        raise TrainbookError(f"{path} is not a directory", where="model.init_from")
    return Path(path)


def read_hf_config(path: Path) -> dict:
    """The parsed `config.json` of Hugging Face model directory `path`."""
    path = Path(path)
    if not path.is_dir():
        why = "not a directory (a Hugging Face model directory holds config.json and the weights)"
        raise TrainbookError(why, where=str(path))
    file = path / CONFIG_FILE
    if not file.is_file():
        raise TrainbookError(f"no {CONFIG_FILE}: not a Hugging Face model directory", where=str(path))
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise TrainbookError(f"not valid JSON: {e}", where=str(file)) from None
    if not isinstance(config, dict):
        raise TrainbookError("not a JSON object", where=str(file))
    return config


def model_config_from_hf(path: Path) -> ModelConfig:
    """The trainbook model equal to the Hugging Face model in directory `path`: every field set
    (a resolved config, so `build_model` takes it as is), named "from_hf".

    Anything trainbook would compute differently from transformers is a TrainbookError naming
    it, where= the config.json: another architecture, scaled RoPE, a bias trainbook has no place
    for, another activation, sliding-window attention.
    """
    config = read_hf_config(path)
    where = str(Path(path) / CONFIG_FILE)
    fam = families.of_hf_config(config, where)
    problems = families.unsupported(fam, config)
    if problems:
        raise TrainbookError("unsupported: " + "; ".join(problems), where=where)
    values = {}
    for field, (key, default) in _FROM_CONFIG.items():
        if config.get(key) is None and default is None:
            raise TrainbookError(f"'{key}' is missing", where=where)
        values[field] = default if config.get(key) is None else config[key]
    values["n_kv_heads"] = _kv_heads(fam, config, values["n_heads"], where)
    values["rope_theta"] = families.rope_theta(config)
    values["max_seq_len"] = config.get("max_position_embeddings") or fam.max_position_embeddings
    values |= {"family": fam.name, **_options(fam, config, values)}
    if fam.moe:
        values |= families.moe_of_hf_config(fam, config, values["n_layers"], where)
    if fam.mla:
        values["head_dim"] = values["qk_rope_head_dim"]  # as DeepseekV3Config sets it
    try:
        cfg = ModelConfig(name=FROM_HF, **values)
    except ValidationError as e:
        err = e.errors()[0]
        key = _HF_KEY.get(str(err["loc"][0]), err["loc"][0])
        raise TrainbookError(f"'{key}': {err['msg']} (got {err['input']!r})", where=where) from None
    _check_heads(cfg, config, where)
    return cfg


def _kv_heads(fam: families.Family, config: dict, n_heads, where: str):
    # As transformers reads it: left out, the family config's default (Qwen: 32); null, the query heads.
    if fam.mla:  # keys and values are expanded per head: transformers' repeat_kv then works only at 1
        given = config.get("num_key_value_heads")
        if given is not None and given != n_heads:
            raise TrainbookError(f"num_key_value_heads={given} differs from num_attention_heads={n_heads}; "
                                 f"{fam.architecture}'s latent attention expands a key and a value per head",
                                 where=where)
        return n_heads
    if "num_key_value_heads" not in config:
        return fam.num_key_value_heads or n_heads
    return config["num_key_value_heads"] if config["num_key_value_heads"] is not None else n_heads


def _options(fam: families.Family, config: dict, values: dict) -> dict:
    dim, heads = values["dim"], values["n_heads"]
    if not isinstance(dim, int) or not isinstance(heads, int) or heads < 1:
        return {}  # ModelConfig names the bad key
    options = fam.defaults(dim, heads)
    if config.get("head_dim") is not None:
        options["head_dim"] = config["head_dim"]
    return options


def _check_heads(cfg: ModelConfig, config: dict, where: str) -> None:
    # The registry's shape checks, in config.json's words.
    if config.get("head_dim") is None and cfg.kv_lora_rank is None and cfg.dim % cfg.n_heads:
        why = f"hidden_size={cfg.dim} is not divisible by num_attention_heads={cfg.n_heads}"
        raise TrainbookError(why, where=where)
    if cfg.n_heads % cfg.n_kv_heads:
        why = f"num_attention_heads={cfg.n_heads} is not a multiple of num_key_value_heads={cfg.n_kv_heads}"
        if "num_key_value_heads" not in config:
            why += " (its default where config.json leaves it out)"
        raise TrainbookError(why, where=where)
    if cfg.head_dim % 2:
        raise TrainbookError(f"head_dim={cfg.head_dim} is odd; RoPE needs an even head_dim", where=where)
    if cfg.n_experts is not None and cfg.n_experts_per_token > cfg.n_experts:
        why = f"num_experts_per_tok={cfg.n_experts_per_token} is more than num_experts={cfg.n_experts}"
        raise TrainbookError(why, where=where)


# Fields whose difference changes what the imported weights compute (shapes, RoPE base, norm
# epsilon, tying). max_seq_len and init_std are the recipe's to choose.
_SAME_AS_IMPORTED = ("family", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "qkv_bias", "qk_norm",
                     "ffn_dim", "norm_eps", "rope_theta", "tie_embeddings", *MOE_FIELDS, *MLA_FIELDS)  # fmt: skip


def check_against_recipe(hf_cfg: ModelConfig, recipe_cfg: ModelConfig) -> None:
    """Raise unless recipe model `recipe_cfg` can take the weights of imported model `hf_cfg`.

    A recipe naming a registry entry is resolved and compared on every field of
    `_SAME_AS_IMPORTED`; a recipe named "from_hf" only on the fields it sets. `vocab_size` may be
    larger in the recipe (a vocabulary resize grows the imported embedding), not smaller.
    The error names the recipe key and both values.
    """
    recipe = recipe_cfg
    if recipe.name != FROM_HF and not is_resolved(recipe):
        recipe = resolve(recipe)
    for field in _SAME_AS_IMPORTED:
        ours, theirs = getattr(recipe, field), getattr(hf_cfg, field)
        if ours is not None and ours != theirs:
            raise TrainbookError(
                f"the recipe's model has {field}={ours}, the Hugging Face model "
                f"{_HF_KEY[field]}={theirs}",
                where=f"model.{field}",
            )
    if recipe.vocab_size is not None and recipe.vocab_size < hf_cfg.vocab_size:
        raise TrainbookError(
            f"the recipe's model has vocab_size={recipe.vocab_size}, smaller than the Hugging Face "
            f"model's {hf_cfg.vocab_size} (a vocabulary can grow on import, not shrink)",
            where="model.vocab_size",
        )


# ---- import: weights ----------------------------------------------------------------------------

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
_MAX_ITEMSIZE = 8  # bytes per element of the widest of them
# Most file bytes one read maps at a time: small beside any model worth importing, big enough
# that the opens cost nothing (a 1.25 GB fp32 file: ~80 of them in ~2 s of reading).
_CHUNK_BYTES = 64 * 2**20
# Buffers some older transformers versions saved; both sides derive them from the config.
_DERIVED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@torch.no_grad()
def load_hf_weights(model: Llama, path: Path) -> None:
    """Copy the weights of Hugging Face directory `path` into built `model`, converting dtype.

    Checked from the files' headers before anything is copied (a failed import leaves the model
    as it was): every parameter (and persistent buffer) has a tensor, of its shape and a float dtype, and every tensor
    maps to a parameter (old `rotary_emb.inv_freq` buffers aside). A tied model's head is its
    embedding: a `lm_head.weight` in the files is ignored, as transformers does; an untied model
    needs one.

    Memory: the model plus at most `_CHUNK_BYTES`. safetensors memory-maps the file, and the
    pages a mapping has read stay resident, counted in the process's RSS, until it closes: one
    `safe_open` per file would hold a whole shard (+1.0 GB reading a 1 GB file), one per tensor
    the largest tensor (+0.26 GB there, a 32K x 2048 fp32 embedding). So each block of rows of
    at most `_CHUNK_BYTES` gets a `safe_open` of its own (benchmarks/hf_import.py). Nothing is
    unpickled.
    """
    path = Path(path)
    files = _weight_files(path)  # HF name -> the file holding it
    params = dict(model.named_parameters(remove_duplicate=False))
    # and the persistent buffers: a DeepSeek-V3 router's selection bias (`e_score_correction_bias`)
    params |= {name: t for name, t in model.state_dict(keep_vars=True).items() if name not in params}
    pieces = _sources(model, params)  # (HF name, what it fills, the model's name of that) each
    _check_names(files, {hf_name for hf_name, _, _ in pieces}, model.cfg, path)
    _check_headers(files, pieces)
    for hf_name, dest, _ in pieces:
        row_bytes = dest[0].numel() * _MAX_ITEMSIZE
        rows = max(1, _CHUNK_BYTES // row_bytes)
        for start in range(0, dest.shape[0], rows):
            with _open(files[hf_name]) as f:
                dest[start : start + rows].copy_(f.get_slice(hf_name)[start : start + rows])


def _sources(model: Llama, params: dict) -> list[tuple[str, torch.Tensor, str]]:
    """(HF name, the tensor it is copied into, that tensor's trainbook name) for every tensor the
    files must hold: a parameter, or for a stacked expert weight each expert's row."""
    pieces = []
    for name, param in params.items():
        assert not param.is_meta, f"{name} is on the meta device: materialise the model first"
        if name == "output.weight" and model.cfg.tie_embeddings:
            if params.get("tok_embeddings.weight") is param:
                continue  # the same tensor: read once, as the embedding
            pieces.append((to_hf_name("tok_embeddings.weight"), param, name))  # a head untied by hand (to_empty)
        elif (rows := expert_names(name, param.shape[0])) is not None:
            pieces += [(hf_name, param[e], f"{name}[{e}]") for e, hf_name in enumerate(rows)]
        else:
            pieces.append((to_hf_name(name), param, name))
    return pieces


def _weight_files(path: Path) -> dict[str, Path]:
    if not path.is_dir():
        raise TrainbookError("not a directory", where=str(path))
    index, single = path / INDEX_FILE, path / WEIGHTS_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = {str(name): path / shard for name, shard in weight_map.items()}
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
            raise TrainbookError("not a safetensors index (no 'weight_map')", where=str(index)) from None
        missing = sorted({f.name for f in files.values() if not f.is_file()})
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise TrainbookError(f"shard '{missing[0]}'{more} named here is missing", where=str(index))
        return files
    if single.is_file():
        with _open(single) as f:
            return {name: single for name in f.keys()}
    if any(path.glob("pytorch_model*.bin")):
        raise TrainbookError(
            "the weights here are PyTorch pickles (pytorch_model.bin), which trainbook never loads "
            "(unpickling can run code): convert them to safetensors first",
            where=str(path),
        )
    raise TrainbookError(f"no weights: neither {WEIGHTS_FILE} nor {INDEX_FILE}", where=str(path))


def _check_names(files: dict[str, Path], wanted: set[str], cfg: ModelConfig, path: Path) -> None:
    ignored = {n for n in files if _DERIVED.fullmatch(n)}
    if families.family(cfg.family).mla:
        # DeepSeek-V3's multi-token-prediction layers follow the last block; transformers does not
        # build them either (DeepseekV3PreTrainedModel._keys_to_ignore_on_load_unexpected).
        mtp = read_hf_config(path).get("num_nextn_predict_layers") or 0
        extra = range(cfg.n_layers, cfg.n_layers + mtp) if isinstance(mtp, int) else range(0)
        ignored |= {n for n in files if (m := _HF_LAYER.match(n)) and int(m.group(1)) in extra}
    if cfg.tie_embeddings:
        ignored.add(to_hf_name("output.weight"))
    unknown = sorted(set(files) - wanted - ignored)
    if unknown:
        why = f"the weights have {_few(unknown)}, which this model (config.json) has no parameter for"
        raise TrainbookError(why, where=str(path))
    missing = sorted(wanted - set(files))
    if to_hf_name("output.weight") in missing:
        raise TrainbookError(
            "the weights have no 'lm_head.weight', and the model does not tie its output head "
            "to the embedding (tie_word_embeddings is false)",
            where=str(path),
        )
    if missing:
        raise TrainbookError(f"the weights lack {_few(missing)}", where=str(path))


def _check_headers(files: dict[str, Path], pieces: list[tuple[str, torch.Tensor, str]]) -> None:
    by_file = defaultdict(list)
    for hf_name, dest, name in pieces:
        by_file[files[hf_name]].append((hf_name, dest, name))
    for file, named in by_file.items():
        with _open(file) as f:
            present = set(f.keys())
            for hf_name, dest, name in named:
                if hf_name not in present:
                    raise TrainbookError(f"no '{hf_name}' here, though the index says so", where=str(file))
                piece = f.get_slice(hf_name)
                shape, want = list(piece.get_shape()), list(dest.shape)
                if shape != want:
                    why = f"'{hf_name}' has shape {shape} in the weights, the model's '{name}' {want}"
                    raise TrainbookError(why, where=str(file))
                if piece.get_dtype() not in _FLOAT_DTYPES:
                    why = (f"'{hf_name}' is {piece.get_dtype()}; trainbook imports float weights "
                           f"({', '.join(_FLOAT_DTYPES)}), not quantised ones")  # fmt: skip
                    raise TrainbookError(why, where=str(file))


def _open(file: Path):
    """`safe_open` for torch, a corrupt file being a one-line error naming it."""
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # SafetensorError, or OSError from the Rust side
        raise TrainbookError(f"not a readable safetensors file: {one_line(e)}", where=str(file)) from None


def _few(names: list[str], n: int = 3) -> str:
    shown = ", ".join(f"'{x}'" for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")

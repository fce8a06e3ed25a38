"""`trainbook export`: a checkpoint's model weights as a safetensors file or a Hugging Face folder.

    --format safetensors   OUT/model.safetensors      trainbook parameter names (LoRA adapters
                                                      included, unmerged); the step and the
                                                      model config in its `__metadata__`
    --format hf            OUT/model.safetensors      the family's Hugging Face names (model.hf): Llama, Qwen2, Qwen3
                           OUT/config.json            from the run's resolved model config
                           OUT/generation_config.json the tokenizer's bos/eos/pad ids
                           OUT/<tokenizer files>      the run's `tokenizer/` folder, plus
                                                      tokenizer_config.json for a tokenizer.json;
                                                      that file's post-processor is set to add what
                                                      the run adds (BOS with `add_bos`, else none);
                                                      a LoRA run's adapters merged: W + alpha/r B A
    --format peft          OUT/adapter_model.safetensors  a LoRA run's adapters alone, in PEFT's
                           OUT/adapter_config.json        layout and names (model/lora.py), for
                                                      `PeftModel.from_pretrained(<base HF folder>, OUT)`

Only the checkpoint's `model.*` entries are read, straight into tensors of the export dtype: no
model is initialised and no optimizer state is allocated, so peak memory is one copy of the weights
in that dtype. DCP assembles each tensor whole from however many shards and ranks wrote it.
A tied embedding is written once (`tok_embeddings.weight`; HF: `model.embed_tokens.weight`).

OUT appears complete or not at all: everything is written into OUT.tmp, synced, then renamed.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from trainbook.atomic import fsync_dir
from trainbook.checkpoint import load_state, locate, step_of, tensor_entries
from trainbook.checkpoint.store import MANIFEST
from trainbook.config import LoraConfig, ModelConfig, load_config
from trainbook.data.tokenizer import META_FILE, match_post_processor
from trainbook.errors import TrainbookError
from trainbook.model import build_model, resolve
from trainbook.model.hf import hf_config, to_hf_state_dict
from trainbook.model.lora import apply_lora, merged_state_dict, peft_target_modules, to_peft_state_dict
from trainbook.runs import RunPaths

FORMATS = ("safetensors", "hf", "peft")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WEIGHTS_FILE = "model.safetensors"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"


def export_command(target: Path, fmt: str, out: Path, dtype: str = "fp32") -> str:
    """Run `export` and return the line the CLI prints."""
    out = export(target, fmt, out, dtype)
    size_mb = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    return f"exported {fmt} ({dtype}, {size_mb:,.1f} MB) -> {out}"


def export(target: Path, fmt: str, out: Path, dtype: str = "fp32") -> Path:
    """Write the model of checkpoint (or run's latest checkpoint) `target` to new folder `out`."""
    _check_choice(fmt, FORMATS, "--format")
    _check_choice(dtype, DTYPES, "--dtype")
    out = Path(out)
    _check_out(out)
    run_dir, ckpt = locate(target)
    run = RunPaths.of(run_dir)
    # Training writes the resolved config into the manifest, so a checkpoint copied out of its
    # run still exports; the run's config.resolved.toml is the fallback.
    saved = json.loads((ckpt / MANIFEST).read_text(encoding="utf-8")).get("config", {})
    cfg = resolve(ModelConfig(**saved["model"]) if saved.get("model") else load_config(run.config).model)
    lora = LoraConfig(**saved.get("lora", {})) if saved.get("model") else load_config(run.config).lora
    if fmt == "peft" and not lora.enabled:
        raise TrainbookError("the run trained no LoRA adapters (lora.rank = 0); export it with --format hf "
                             "or safetensors", where="--format peft")
    weights = read_weights(ckpt, cfg, DTYPES[dtype], lora)
    if cfg.tie_embeddings:
        # Same tensor twice in the state dict; safetensors refuses aliases and one copy is enough.
        weights.pop("output.weight")
    # "format": "pt" is what transformers requires of a safetensors file's metadata.
    step = step_of(ckpt)  # None for a checkpoint folder renamed by hand
    metadata = {"format": "pt", "trainbook.step": str(step) if step is not None else "unknown",
                "trainbook.dtype": dtype}  # fmt: skip

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an export that crashed
    tmp.mkdir(parents=True)
    try:
        if fmt == "safetensors":
            metadata["trainbook.model"] = json.dumps(cfg.model_dump(mode="json"))
            metadata["trainbook.lora"] = json.dumps(lora.model_dump(mode="json"))
            save_file(weights, tmp / WEIGHTS_FILE, metadata=metadata | {"trainbook.layout": "trainbook"})
        elif fmt == "peft":
            _write_peft(tmp, weights, cfg, lora, metadata)
        else:
            merged = merged_state_dict(weights, lora.scale) if lora.enabled else weights
            _write_hf(tmp, merged, cfg, DTYPES[dtype], run.tokenizer, metadata)
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; a half export otherwise
    return out


def read_weights(ckpt: Path, cfg: ModelConfig, dtype: torch.dtype,
                 lora: LoraConfig | None = None) -> dict[str, torch.Tensor]:
    """The model tensors of checkpoint `ckpt`, full and on CPU, in `dtype`, by trainbook name
    (with `lora`'s adapters, `....lora_a.weight` / `....lora_b.weight`, when it is enabled).

    Checked first against the shapes `cfg` gives, so a checkpoint from another model is named as
    such rather than failing inside DCP.
    """
    model = build_model(cfg, "meta", seed=0)
    apply_lora(model, lora or LoraConfig(), seed=0)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    _check_shapes(ckpt, _saved_model_shapes(ckpt), expected)
    # Loaded straight into `dtype`: DCP copies each saved tensor into the one given (copy_
    # converts, rounding to nearest as .to() does), so no full fp32 copy is held alongside.
    weights = {k: torch.empty(shape, dtype=dtype) for k, shape in expected.items()}
    load_state(ckpt, {"model": weights})
    for name, t in weights.items():
        if not torch.isfinite(t).all():
            fp16 = dtype == torch.float16
            why = "overflows fp16 (|w| > 65504); try --dtype bf16" if fp16 else "holds inf/nan"
            raise TrainbookError(f"'model.{name}' {why}", where=str(ckpt))
    return weights


def _saved_model_shapes(ckpt: Path) -> dict[str, tuple[int, ...]]:
    entries = tensor_entries(ckpt).items()
    return {key.removeprefix("model."): tuple(item.size) for key, item in entries if key.startswith("model.")}


def _check_shapes(ckpt: Path, saved: dict[str, tuple], expected: dict[str, tuple]) -> None:
    for name, shape in expected.items():
        if name not in saved:
            raise TrainbookError(
                f"the checkpoint has no 'model.{name}', which the run's model config needs",
                where=str(ckpt),
            )
        if saved[name] != shape:
            raise TrainbookError(
                f"'model.{name}' has shape {list(saved[name])} in the checkpoint, "
                f"{list(shape)} in the run's model config",
                where=str(ckpt),
            )
    extra = sorted(set(saved) - set(expected))
    if extra:
        raise TrainbookError(
            f"the checkpoint has 'model.{extra[0]}', which the run's model config does not",
            where=str(ckpt),
        )


def _write_hf(
    tmp: Path, weights: dict, cfg: ModelConfig, dtype: torch.dtype, tokenizer_dir: Path, metadata: dict
) -> None:
    hf_weights = to_hf_state_dict(weights, tied=cfg.tie_embeddings)
    save_file(hf_weights, tmp / WEIGHTS_FILE, metadata=metadata | {"trainbook.layout": "hf"})
    specials = _tokenizer_specials(tokenizer_dir)
    ids = {name: (specials.get(name) or {}).get("id") for name in ("bos", "eos", "pad")}
    _write_json(tmp / "config.json", hf_config(cfg, dtype, **{f"{n}_id": i for n, i in ids.items()}))
    if any(i is not None for i in ids.values()):
        # What `generate` stops on and pads with; transformers reads it from here, not config.json.
        _write_json(tmp / "generation_config.json", {f"{n}_token_id": i for n, i in ids.items()})
    if tokenizer_dir.is_dir():
        for f in sorted(tokenizer_dir.iterdir()):
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
    if (tmp / "tokenizer.json").is_file():
        if match_post_processor(tmp / "tokenizer.json", specials["bos"] if specials.get("add_bos") else None):
            # tokenizer_meta.json names the file as trained, by its sha256: it would now fail to load.
            (tmp / META_FILE).unlink(missing_ok=True)
        _write_json(tmp / "tokenizer_config.json", _hf_tokenizer_config(specials, cfg.max_seq_len))


def _write_peft(tmp: Path, weights: dict, cfg: ModelConfig, lora: LoraConfig, metadata: dict) -> None:
    """The adapters under PEFT's names, and the LoraConfig PEFT reads (peft 0.21's field names;
    the base model is the folder the run started from, or the run's own `--format hf` export)."""
    save_file(to_peft_state_dict(weights), tmp / PEFT_WEIGHTS_FILE, metadata=metadata | {"trainbook.layout": "peft"})
    base = cfg.init_from.removeprefix("hf:") if cfg.init_from and cfg.init_from.startswith("hf:") else None
    _write_json(tmp / "adapter_config.json", {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": peft_target_modules(weights, cfg.n_layers),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,  # the scale is alpha / r, not alpha / sqrt(r)
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    })


def _tokenizer_specials(tokenizer_dir: Path) -> dict:
    """{"bos"|"eos"|"pad": {"token", "id"} or None, "add_bos": bool} from the saved tokenizer's
    meta file; {} when the run has none (the ids are then written as unknown)."""
    meta = tokenizer_dir / META_FILE
    if not meta.is_file():
        return {}
    try:
        return json.loads(meta.read_text(encoding="utf-8"))
    except ValueError as e:
        raise TrainbookError(f"unreadable tokenizer meta: {e}", where=str(meta)) from None


def _hf_tokenizer_config(specials: dict, max_len: int) -> dict:
    # Names the specials (without it transformers' tokenizer knows no eos_token_id) and picks the
    # generic fast class, which runs tokenizer.json as trainbook does; transformers 4.x would
    # otherwise pick LlamaTokenizerFast for model_type "llama", which inserts a BOS of its own.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
              "clean_up_tokenization_spaces": False}  # fmt: skip
    for name in ("bos", "eos", "pad"):
        if specials.get(name):
            config[f"{name}_token"] = specials[name]["token"]
    return config


def _publish(tmp: Path, out: Path) -> None:
    """Sync tmp's files and rename tmp to out: a crash leaves out absent (or as it was), never half
    written."""
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fsync_dir(tmp)
    try:
        os.replace(tmp, out)  # replaces an empty `out` folder, never a non-empty one
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise
        why = "exists and is not empty (written while exporting?)"
        raise TrainbookError(why, where=f"--out {out}") from None
    fsync_dir(out.parent)


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        why = "exists and is not empty; export into a new or empty folder"
        raise TrainbookError(why, where=f"--out {out}")


def _check_choice(value: str, choices, flag: str) -> None:
    if value not in choices:
        raise TrainbookError(f"unknown value {value!r} (choose from {', '.join(choices)})", where=flag)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")

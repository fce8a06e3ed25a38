"""Parallel degrees, validated against the world size and the model before any process group starts.

The device mesh has up to four named dimensions, outermost first:

    pp            pipeline stages: ranks that hand activations to each other (point-to-point)
    dp_replicate  HSDP/DDP replicas: gradients all-reduced across them
    dp_shard      FSDP2 shards: parameters all-gathered, gradients reduce-scattered
    tp            tensor parallel: ranks that split each matmul (innermost, so on one node)

A rank's place in the world is row-major over (pp, dp_replicate, dp_shard, tp): the tp ranks of one
group are consecutive, which keeps the most talkative dimension within a node. Data-parallel ranks
(dp_replicate x dp_shard of them) each read a different slice of every global batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainbook.config import Config
from trainbook.errors import TrainbookError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: how many slices each global batch is cut into."""
        return self.dp_replicate * self.dp_shard

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIMS}

    def coordinate(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dimension (row-major, tp innermost)."""
        coords = {}
        for name in reversed(MESH_DIMS):
            rank, coords[name] = divmod(rank, getattr(self, name))
        return {name: coords[name] for name in MESH_DIMS}

    def dp_rank(self, rank: int) -> int:
        c = self.coordinate(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def build_mesh(self, device_type: str):
        """The DeviceMesh over all four dimensions (size-1 ones included, so names always exist)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, tuple(self.sizes().values()), mesh_dim_names=MESH_DIMS)


def resolve_dims(cfg: Config, world_size: int, where: str) -> ParallelDims:
    """The layout for `world_size` ranks: -1 filled in, then every check that needs no process."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    degrees = {k: getattr(p, k) for k in MESH_DIMS[1:] + ("pp",)}
    if -1 in degrees.values():
        rest, known = [k for k, v in degrees.items() if v == -1][0], 1
        for k, v in degrees.items():
            known *= v if v != -1 else 1
        if world_size % known:
            raise TrainbookError(
                f"the other degrees multiply to {known}, which does not divide the world size {world_size}",
                where=f"{where}: parallel.{rest}",
            )
        degrees[rest] = world_size // known
    dims = ParallelDims(degrees["dp_replicate"], degrees["dp_shard"], degrees["tp"], degrees["pp"])
    if dims.world_size != world_size:
        layout = " x ".join(f"{k}={v}" for k, v in dims.sizes().items())
        raise TrainbookError(f"{layout} = {dims.world_size} ranks, but the world size is {world_size}",
                             where=f"{where}: parallel")

    for heads in ("n_heads", "n_kv_heads"):
        if getattr(m, heads) % dims.tp:
            raise TrainbookError(f"model.{heads} = {getattr(m, heads)} is not divisible by tp = {dims.tp}",
                                 where=f"{where}: parallel.tp")
    if p.data_parallel == "ddp" and dims.dp_shard != 1:
        raise TrainbookError(f"ddp replicates whole models: it needs dp_shard = 1, not {dims.dp_shard}",
                             where=f"{where}: parallel.data_parallel")
    per_step = t.seq_len * t.micro_batch_size * dims.dp
    if t.global_batch_tokens is not None and t.global_batch_tokens % per_step:
        raise TrainbookError(
            f"global_batch_tokens = {t.global_batch_tokens} is not a multiple of seq_len x "
            f"micro_batch_size x data-parallel ranks = {t.seq_len} x {t.micro_batch_size} x {dims.dp}",
            where=f"{where}: train.global_batch_tokens",
        )
    if dims.pp > 1:
        _check_pipeline(cfg, dims, where)
    return dims


def _check_pipeline(cfg: Config, dims: ParallelDims, where: str) -> None:
    p, n_layers = cfg.parallel, cfg.model.n_layers
    if cfg.precision.dtype == "fp16":
        raise TrainbookError("fp16 needs loss scaling, which the pipeline schedules do not apply yet; "
                             "use bf16 with pp > 1", where=f"{where}: precision.dtype")
    stages = dims.pp * p.pp_stages_per_rank
    if p.pp_schedule == "interleaved1f1b" and p.pp_stages_per_rank < 2:
        raise TrainbookError("interleaved1f1b needs pp_stages_per_rank >= 2", where=f"{where}: parallel.pp_stages_per_rank")
    if p.pp_schedule != "interleaved1f1b" and p.pp_stages_per_rank != 1:
        raise TrainbookError(f"{p.pp_schedule} runs one stage per rank; pp_stages_per_rank must be 1",
                             where=f"{where}: parallel.pp_stages_per_rank")
    if p.pp_split is not None:
        if len(p.pp_split) != stages or any(n < 1 for n in p.pp_split) or sum(p.pp_split) != n_layers:
            raise TrainbookError(
                f"{p.pp_split} must be {stages} positive layer counts (one per stage) adding up to "
                f"model.n_layers = {n_layers}", where=f"{where}: parallel.pp_split",
            )
    elif n_layers < stages:
        raise TrainbookError(f"{stages} pipeline stages need at least {stages} layers; the model has {n_layers}",
                             where=f"{where}: parallel.pp")
    microbatches = p.pp_microbatches or stages
    if p.pp_schedule != "gpipe" and microbatches < dims.pp:
        raise TrainbookError(
            f"{p.pp_schedule} needs at least as many micro-batches as pipeline ranks ({dims.pp}); got {microbatches}",
            where=f"{where}: parallel.pp_microbatches",
        )
    if cfg.train.micro_batch_size % microbatches:
        raise TrainbookError(
            f"train.micro_batch_size = {cfg.train.micro_batch_size} cannot be cut into {microbatches} "
            "pipeline micro-batches", where=f"{where}: parallel.pp_microbatches",
        )

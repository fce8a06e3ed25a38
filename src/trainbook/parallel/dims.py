"""Parallel degrees, validated against the world size and the model before any process group starts.

The device mesh has up to four named dimensions, outermost first:

    pp            pipeline stages: ranks that hand activations to each other (point-to-point)
    dp_replicate  HSDP/DDP replicas: gradients all-reduced across them
    dp_shard      FSDP2 shards: parameters all-gathered, gradients reduce-scattered
    cp            context parallel: ranks that split each sequence (parallel/cp.py); FSDP2
                  shards parameters over dp_shard x cp
    tp            tensor parallel: ranks that split each matmul (innermost, so on one node)

A rank's place in the world is row-major over (pp, dp_replicate, dp_shard, cp, tp): the tp ranks of
one group are consecutive, which keeps the most talkative dimension within a node, and the cp ranks
next. Data-parallel ranks (dp_replicate x dp_shard of them) each read a different slice of every
global batch; the cp and tp ranks of one read the same samples.

Expert parallelism splits dp_shard once more, for a mixture of experts' routed experts only:
dp_shard = efsdp x ep, ep innermost (its ranks consecutive, as tp's: the all-to-all of tokens
stays within a node where it can). The `expert_mesh` has the dimensions

    pp, dp_replicate, efsdp, ep, tp

over the same ranks: an ep group holds the experts between them (each rank n_experts / ep of
them), and the ranks holding the same experts (efsdp x dp_replicate of them) shard and reduce them
as FSDP does the rest of the model over dp_shard.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainbook.config import ParallelConfig
from trainbook.errors import TrainbookError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    ep: int = 1
    """Expert-parallel degree, carved out of dp_shard (not a dimension of `build_mesh`'s mesh)."""
    cp: int = 1
    """Context-parallel degree: ranks splitting each sequence."""

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: how many slices each global batch is cut into."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks whose gradients are averaged, and over which FSDP2 shards (with dp_replicate):
        the data-parallel ranks, each split into cp ranks holding shares of its sequences."""
        return self.dp * self.cp

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIMS}

    def label(self) -> str:
        """"dp_shard 2 (ep 2) x tp 2": the degrees above 1, ep beside the dp_shard it splits."""
        return " x ".join(f"{k} {v}" + (f" (ep {self.ep})" if k == "dp_shard" and self.ep > 1 else "")
                          for k, v in self.sizes().items() if v > 1)

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
        """The DeviceMesh over all five dimensions (size-1 ones included, so names always exist)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, tuple(self.sizes().values()), mesh_dim_names=MESH_DIMS)

    @property
    def efsdp(self) -> int:
        """Ranks of dp_shard holding the same experts (experts FSDP-shard over them)."""
        return self.dp_shard // self.ep

    def expert_mesh(self, mesh):
        """`mesh` with dp_shard split into (efsdp, ep), ep innermost (the module docstring)."""
        return mesh._unflatten("dp_shard", (self.efsdp, self.ep), ("efsdp", "ep"))


def resolve_dims(parallel: ParallelConfig, world_size: int, where: str) -> ParallelDims:
    """The layout for `world_size` ranks: -1 filled in, then the checks of `[parallel]` alone
    (those that involve the model or the batch are the recipe resolution's)."""
    p = parallel
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
    dims = ParallelDims(degrees["dp_replicate"], degrees["dp_shard"], degrees["tp"], degrees["pp"], p.ep,
                        cp=degrees["cp"])
    if dims.world_size != world_size:
        layout = " x ".join(f"{k}={v}" for k, v in dims.sizes().items() if k != "cp" or v > 1)
        raise TrainbookError(f"{layout} = {dims.world_size} ranks, but the world size is {world_size}",
                             where=f"{where}: parallel")
    if p.data_parallel == "ddp" and dims.dp_shard != 1:
        raise TrainbookError(f"ddp replicates whole models: it needs dp_shard = 1, not {dims.dp_shard}",
                             where=f"{where}: parallel.data_parallel")
    if dims.dp_shard % dims.ep:
        raise TrainbookError(f"expert parallelism is carved out of dp_shard: ep = {dims.ep} must divide "
                             f"dp_shard = {dims.dp_shard}", where=f"{where}: parallel.ep")
    if dims.ep > 1 and dims.tp > 1:
        raise TrainbookError(f"expert parallelism with tensor parallelism (tp = {dims.tp}) is not built yet; "
                             "use tp = 1 with ep > 1", where=f"{where}: parallel.ep")
    if dims.ep > 1 and dims.pp > 1:
        raise TrainbookError(f"expert parallelism with pipeline parallelism (pp = {dims.pp}) is not built yet; "
                             "use pp = 1 with ep > 1", where=f"{where}: parallel.ep")
    if dims.cp > 1:
        if dims.ep > 1:
            raise TrainbookError(f"context parallelism with expert parallelism (ep = {dims.ep}) is not built yet; "
                                 "use ep = 1 with cp > 1", where=f"{where}: parallel.cp")
        if dims.pp > 1 and dims.tp > 1:
            # A later stage receives a sequence-parallel shard of this rank's share (T / cp / tp)
            # and could not tell the share's global positions from it.
            raise TrainbookError(f"context parallelism with both pipeline (pp = {dims.pp}) and tensor parallelism "
                                 f"(tp = {dims.tp}) is not built yet; use pp = 1 or tp = 1 with cp > 1",
                                 where=f"{where}: parallel.cp")
        if p.data_parallel == "ddp":
            raise TrainbookError("context parallelism shards parameters over dp_shard x cp with FSDP2; "
                                 "ddp does not take it", where=f"{where}: parallel.cp")
    _check_compression(p, dims, where)
    if dims.pp > 1:
        _check_schedule(p, dims, where)
    return dims


def _check_compression(p: ParallelConfig, dims: ParallelDims, where: str) -> None:
    """Each gradient-compression setting belongs to one data-parallel implementation."""
    if p.grad_compression != "none" and p.data_parallel != "ddp":
        raise TrainbookError(f"grad_compression = {p.grad_compression} is a DDP communication hook; FSDP2 "
                             "reduces in bf16 with parallel.reduce_dtype = \"bf16\"",
                             where=f"{where}: parallel.grad_compression")
    if p.reduce_dtype != "fp32" and p.data_parallel != "fsdp":
        raise TrainbookError(f"reduce_dtype = {p.reduce_dtype} is FSDP2's; DDP compresses with "
                             f"parallel.grad_compression = \"{p.reduce_dtype}\"", where=f"{where}: parallel.reduce_dtype")
    for name, degree in (("pp", dims.pp), ("tp", dims.tp)):
        if p.grad_compression != "none" and degree > 1:
            raise TrainbookError(f"gradient compression with {name} = {degree} is not built yet; use {name} = 1",
                                 where=f"{where}: parallel.grad_compression")
    if p.sync_every:
        _check_local_sgd(p, dims, f"{where}: parallel.sync_every")


def _check_local_sgd(p: ParallelConfig, dims: ParallelDims, where: str) -> None:
    """Delayed synchronisation trains whole DDP replicas apart (parallel/local_sgd.py)."""
    if p.data_parallel != "ddp" or dims.dp_shard > 1:
        raise TrainbookError(f"sync_every = {p.sync_every} trains whole replicas apart: it needs "
                             "parallel.data_parallel = \"ddp\" (dp_shard = 1)", where=where)
    for name, degree in (("tp", dims.tp), ("pp", dims.pp), ("cp", dims.cp), ("ep", dims.ep)):
        if degree > 1:
            raise TrainbookError(f"sync_every with {name} = {degree} is not built yet; use {name} = 1", where=where)
    if p.grad_compression != "none":
        raise TrainbookError(f"sync_every = {p.sync_every} sends no gradients to compress; drop "
                             f"parallel.grad_compression = {p.grad_compression}", where=where)


def pipeline_microbatches(parallel: ParallelConfig, pp: int) -> int:
    """Micro-batches per pipeline pass: `pp_microbatches`, or one per stage."""
    return parallel.pp_microbatches or pp * parallel.pp_stages_per_rank


def _check_schedule(p: ParallelConfig, dims: ParallelDims, where: str) -> None:
    if p.pp_schedule == "interleaved1f1b" and p.pp_stages_per_rank < 2:
        raise TrainbookError("interleaved1f1b needs pp_stages_per_rank >= 2", where=f"{where}: parallel.pp_stages_per_rank")
    if p.pp_schedule != "interleaved1f1b" and p.pp_stages_per_rank != 1:
        raise TrainbookError(f"{p.pp_schedule} runs one stage per rank; pp_stages_per_rank must be 1",
                             where=f"{where}: parallel.pp_stages_per_rank")
    microbatches = pipeline_microbatches(p, dims.pp)
    if p.pp_schedule != "gpipe" and microbatches < dims.pp:
        raise TrainbookError(
            f"{p.pp_schedule} needs at least as many micro-batches as pipeline ranks ({dims.pp}); got {microbatches}",
            where=f"{where}: parallel.pp_microbatches",
        )
    if p.pp_schedule == "interleaved1f1b":
        rounds = max(1, microbatches // dims.pp)
        if microbatches % rounds:
            raise TrainbookError(
                f"interleaved1f1b runs micro-batches in rounds of pp = {dims.pp}: {microbatches} "
                f"is not a multiple of its {rounds} rounds", where=f"{where}: parallel.pp_microbatches")

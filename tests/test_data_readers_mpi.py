"""Both readers, at 1, 2, 4 and 8 ranks, in one 8-rank launch.

For every layout (sample, channel and spatial splits, replicated blocks) and both datasets
(int16 channels-last universes cut into sub-cubes with log1p; float32 channels-first
samples with divide-by-mean), each rank's block of every batch must equal the same block
of the batch computed independently in one process, every rank must get the targets of
the whole batch, every sample must come exactly once per epoch in the order of
``order.epoch_batches`` (global shuffle: the same at every rank count), and the bytes read
must add up to the dataset exactly once (preload: once in all; direct: once per epoch).
The local shuffle keeps each sample group's rows inside its shard, and under preload every
sample's owner lies in the group whose shard holds it (no exchange leaves a sample group);
under the global shuffle the ranks holding one block share its store evenly.  A preload that does not
fit in memory stops every rank with the same error.  Cases run in waves on disjoint
sub-communicators; verdicts are allgathered so a failure on one rank fails all.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import abort_on_error
from equivalence import join_case, waves
from test_data_manifest import expected_sample, write_universes

from cosmotrain.config.load import load_config
from cosmotrain.data.readers import order
from cosmotrain.data.synthetic.datagen import generate_dataset
from cosmotrain.data.dataset.manifest import open_manifest
from cosmotrain.data.readers.job_readers import make_readers, open_dataset
from cosmotrain.data.readers.placement import BlockPlacement
from cosmotrain.errors import ConfigError

DATASETS = {  # name -> config overrides
    "universes": ["model.width=4", "train.batch_size=5", "data.transform=log1p"],
    "samples": ["model.width=8", "train.batch_size=3", "data.transform=mean"],
}
RUNS = [  # (dataset, extra overrides)
    ("universes", ["data.reader=preload"]),
    ("universes", ["data.reader=direct", "data.prefetch=true"]),
    ("samples", ["data.reader=preload"]),
    ("samples", ["data.reader=direct", "data.prefetch=false"]),
    ("universes", ["data.reader=preload", "data.shuffle=local"]),
    ("universes", ["data.reader=direct", "data.shuffle=local", "data.drop_last=true"]),
]
CASES = [  # (ranks, name, ways over (sample, channel, depth, height, width))
    (1, "N1", (1, 1, 1, 1, 1)), (2, "D2", (1, 1, 2, 1, 1)), (2, "N2", (2, 1, 1, 1, 1)),
    (4, "N2H2", (2, 1, 1, 2, 1)), (4, "C2W2", (1, 2, 1, 1, 2)),
    (4, "N2 x2 replicas", (2, 1, 1, 1, 1)), (8, "N2D2W2", (2, 1, 2, 1, 2)),
    (8, "N4C2", (4, 2, 1, 1, 1)), (8, "N2D2 x2 replicas", (2, 1, 2, 1, 1)),
]
EPOCHS = 2


def make_datasets(root: Path) -> dict[str, Path]:
    """Both datasets, with their caches built once (so concurrent cases only read)."""
    write_universes(root / "universes", 8, 3, "channels-last", "int16")
    generate_dataset(root / "samples", 9, 8, 2, layout="channels-first", dtype="float32",
                     val_fraction=0.12)
    open_manifest(root / "universes", 4)
    open_manifest(root / "samples", 8, means=True)
    return {name: root / name for name in DATASETS}


def references(paths: dict[str, Path]) -> dict[str, dict]:
    """Every sample of every split, computed without the readers."""
    refs = {}
    for name, path in paths.items():
        cfg = config(paths, name, [])
        manifest = open_manifest(path, cfg.model.width)
        refs[name] = {(split, i): expected_sample(path, split, i, cfg.model.width,
                                                  list(files), cfg.data.transform)
                      for split, files in manifest.files.items()
                      for i in range(manifest.count(split))}
    return refs


def config(paths: dict[str, Path], name: str, extra: list[str]):
    return load_config(None, [f"data.path={paths[name]}", "train.seed=4",
                              *DATASETS[name], *extra])


def placement_of(comm, ways, width) -> BlockPlacement:
    coords = list(itertools.product(*(range(w) for w in ways)))
    return BlockPlacement(ways, coords[comm.Get_rank() % len(coords)], 4, width)


def check_run(comm, paths, refs, name, extra, ways) -> tuple[list[str], dict]:
    """One reader configuration on ``comm``: failures, and the train order it produced."""
    cfg = config(paths, name, extra)
    manifest = open_dataset(cfg, comm)
    placement = placement_of(comm, ways, cfg.model.width)
    readers = make_readers(cfg, manifest, comm, placement)
    failures, orders = [], {}
    shards = ways[0] if cfg.data.shuffle == "local" else 1
    for split, reader in readers.items():
        epochs = EPOCHS if split == "train" else 1
        if cfg.data.reader == "preload" and shards > 1:
            failures += check_local_owners(reader, split, cfg.train.batch_size)
        elif cfg.data.reader == "preload":
            failures += check_even_store(reader, split)
        for epoch in range(epochs):
            seen = []
            drop = cfg.data.drop_last and split == "train"  # validation sees every sample
            expected = order.epoch_batches(4, epoch, reader.count, cfg.train.batch_size,
                                           shuffle=split == "train", shards=shards,
                                           drop_last=drop)
            for index, batch in enumerate(reader.epoch(epoch)):
                failures += check_batch(batch, refs[name], split, expected[index])
                seen += batch.indices.tolist()
            orders[(split, epoch)] = seen
            dropped = reader.count % cfg.train.batch_size if drop else 0
            if sorted(seen) != sorted(set(seen)) or len(seen) != reader.count - dropped:
                failures.append(f"{split} epoch {epoch}: not every sample exactly once")
        failures += check_bytes(comm, reader, manifest, split, epochs, cfg)
    for reader in readers.values():
        reader.close()
    return failures, orders


def check_local_owners(reader, split, batch_size) -> list[str]:
    """Local shuffle: every sample this rank owns lies in its own group's shard, and
    every row of every batch comes from an owner in the row's sample group (so node-local
    staging of a node's own shards is enough)."""
    ranges = order.shard_ranges(reader.count, batch_size, reader.placement.groups)
    mine = ranges[reader.placement.group]
    failures = [f"{split}: owns sample {s} outside its shard {mine}"
                for s in reader.owned if not mine[0] <= s < mine[1]]
    for index in range(reader.batches_per_epoch):
        indices = reader.indices(0, index)
        rows = np.array(reader.placement.row_groups(len(indices)))
        owners = reader.member_group[reader.owner[indices]]
        if not np.array_equal(owners, rows):
            failures.append(f"{split} batch {index}: rows of groups {rows.tolist()} come "
                            f"from owners in groups {owners.tolist()}")
    return failures


def check_even_store(reader, split) -> list[str]:
    """Global shuffle: the ranks holding one block share its store evenly (sample s in
    group s % groups), so no rank holds more than one sample more than another."""
    held = reader.exchange.allgather(len(reader.owned))
    return [] if max(held) - min(held) <= 1 else [f"{split}: store sizes {held}"]


def check_batch(batch, refs, split, expected) -> list[str]:
    if not np.array_equal(batch.indices, expected):
        return [f"{split} batch {batch.index}: order {batch.indices} != {expected}"]
    full = np.stack([refs[(split, int(i))][0] for i in batch.indices])
    labels = np.stack([refs[(split, int(i))][1] for i in batch.indices])
    block = full[batch.x.dist.block(batch.x.coord)]
    problems = []
    if batch.x.data.dtype != np.float32 or not np.allclose(batch.x.data, block, rtol=1e-6):
        problems.append(f"{split} batch {batch.index}: block differs")
    if not np.array_equal(batch.targets, labels):
        problems.append(f"{split} batch {batch.index}: targets differ")
    return problems


def check_bytes(comm, reader, manifest, split, epochs, cfg) -> list[str]:
    """Preload reads the split once in all; direct once per epoch (replicas share)."""
    sample = manifest.itemsize * 4 * cfg.model.width ** 3
    if cfg.data.reader == "preload":
        got, want = comm.allreduce(reader.stats.load_bytes), reader.count * sample
    else:
        delivered = sum(len(reader.indices(e, i))
                        for e in range(epochs) for i in range(reader.batches_per_epoch))
        got, want = comm.allreduce(reader.stats.bytes_read), delivered * sample
    return [] if got == want else [f"{split}: {got} bytes read, expected {want}"]


@pytest.mark.parallel(nprocs=8)
@abort_on_error
def test_readers_deliver_the_one_process_batches_at_every_layout() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    root = Path(world.bcast(tempfile.mkdtemp() if world.rank == 0 else None))
    paths = {name: root / name for name in DATASETS}
    if world.rank == 0:
        make_datasets(root)
    world.Barrier()
    refs = references(paths)
    failures, orders = [], []
    for wave in waves(CASES, world.Get_size()):
        mine, comm = join_case(world, wave)
        if mine is not None:
            for name, extra in RUNS:
                found, seen = check_run(comm, paths, refs, name, extra, mine[2])
                failures += [f"{mine[1]} {name} {extra}: {f}" for f in found]
                if "data.shuffle=local" not in extra:
                    orders.append((name, sorted(seen.items())))
        comm.Free()
    failures += memory_check_failures(world, paths)
    distinct = {name: len({repr(o) for n, o in sum(world.allgather(orders), []) if n == name})
                for name in DATASETS}
    failures += [f"{name}: {n} different orders across rank counts"
                 for name, n in distinct.items() if n != 1]
    failures = sorted(set(sum(world.allgather(failures), [])))
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(root)
    assert not failures, f"{len(failures)} failures: {failures[:20]}"


def memory_check_failures(world, paths) -> list[str]:
    """A store larger than its budget: the same ConfigError on every rank, nothing read."""
    cfg = config(paths, "universes", ["data.reader=preload", "data.memory_fraction=1e-12"])
    manifest = open_dataset(cfg, world)
    placement = placement_of(world, (2, 1, 2, 1, 2), 4)
    with pytest.raises(ConfigError) as err:
        make_readers(cfg, manifest, world, placement)
    messages = set(world.allgather(str(err.value)))
    message = next(iter(messages))
    ok = len(messages) == 1 and "data.reader" in message and "data.reader: direct" in message
    return [] if ok else [f"memory check: {messages}"]

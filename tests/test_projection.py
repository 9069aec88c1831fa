"""benchmarks/projection.py: the model-only projection of the paper's experiments.

Small sizes only (128^3, a few ranks): the figures themselves are the script's business;
these tests check the structure, the accounting and the invariants of the experiments.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import replace

import pytest

from conftest import REPO
from cosmotrain.plan.planner import MEMORY_RESERVE, plan

spec = importlib.util.spec_from_file_location("projection", REPO / "benchmarks" / "projection.py")
projection = importlib.util.module_from_spec(spec)
sys.modules["projection"] = projection  # dataclasses resolve their module by name
spec.loader.exec_module(projection)

V100 = "v100-abci"


@pytest.fixture(scope="module")
def v100():
    return projection.targets([V100])


def test_memory_limit_is_the_planners_per_gpu_default(v100):
    target = v100[0]
    gib = projection.GiB
    assert target.machine.memory_per_node_gib == 4 * 16  # 4 x V100 16 GB
    assert target.memory_bytes == pytest.approx(16 * gib * (1 - MEMORY_RESERVE))
    limits = {t.name: t.memory_bytes / gib for t in projection.targets()}
    assert limits == pytest.approx({V100: 14.4, "a100": 36.0, "h100": 72.0})


def test_plan_targets_ranks_like_the_planner(v100):
    cfg = projection.model_config(128, 8)
    ranked = projection.plan_targets(cfg, 8, v100)[V100]
    ours = [i for i in ranked if i.memory_bytes <= v100[0].memory_bytes]
    theirs = plan(cfg, 8, v100[0].machine, projection.GPUS_PER_NODE)  # default limit
    assert ours and len(ours) == len(theirs)
    assert [i.strategy.describe() for i in ours] == [i.strategy.describe() for i in theirs]
    assert [i.prediction.step_s for i in ours] == pytest.approx(
        [i.prediction.step_s for i in theirs])
    assert [i.memory_bytes for i in ours] == [i.memory_bytes for i in theirs]


def test_weak_scaling_rows_and_efficiency(v100):
    nodes = (1, 2, 4)
    rows = projection.weak_scaling(128, v100, nodes)[V100]
    assert [r.nodes for r in rows] == list(nodes)
    assert [r.batch for r in rows] == [4 * n for n in nodes]  # one sample per GPU
    assert [r.fixed.strategy for r in rows] == ["N4", "N8", "N16"]
    for kind in ("best", "fixed"):
        points = [getattr(r, kind) for r in rows]
        assert all(p.feasible and p.samples_per_s > 0 for p in points)
        assert points[0].speedup == pytest.approx(1.0)
        eff = [p.efficiency for p in points]
        assert eff[0] == pytest.approx(1.0)
        assert all(e <= 1.0 + 1e-9 for e in eff)
        assert all(b <= a + 1e-9 for a, b in zip(eff, eff[1:]))  # decreasing or flat
        for p, n in zip(points, nodes):
            assert p.efficiency == pytest.approx(p.speedup / n)
    for r in rows:  # the fixed strategy is a candidate, so the best is no slower
        assert r.best.samples_per_s >= r.fixed.samples_per_s * (1 - 1e-9)


def test_weak_scaling_256_splits_one_sample_per_node():
    assert projection.weak_batch(256, 8) == 8
    assert projection.weak_fixed(256, 8) == "N8D2H2"
    assert projection.weak_batch(128, 8) == 32


def test_strong_scaling_flags_points_that_do_not_fit():
    one = projection.fixed_points(projection.model_config(128, 1), "N1",
                                  projection.targets([V100]))[V100]
    limit = 0.6 * one.memory_gib  # one GPU cannot hold the sample, four can
    machines = [replace(projection.targets([V100])[0], memory_bytes=limit * projection.GiB)]
    rows = projection.strong_scaling(machines, (1, 2, 4), width=128)[V100]
    first = rows[0].best
    assert not first.feasible and first.samples_per_s == 0.0 and first.speedup is None
    assert first.memory_gib > limit  # the leanest strategy still does not fit
    feasible = [r for r in rows if r.best.feasible]
    assert feasible and feasible[-1].gpus == 4
    assert feasible[0].best.speedup == pytest.approx(1.0)
    for r in feasible:
        assert r.best.memory_gib <= limit
        assert r.best.efficiency == pytest.approx(
            r.best.speedup / (r.gpus / feasible[0].gpus))
    assert rows[-1].over_node == pytest.approx(1.0)  # 4 GPUs is one node
    assert "does not fit" in "\n".join(projection.strong_tables({V100: rows}))


def test_headline_flops_are_three_forward_passes_per_sample(v100):
    heads = projection.headline(v100, gpus=8, batch=2, width=128, search=False)
    h = heads[V100]
    assert h.fixed.strategy == "N2D2H2" and h.node_fixed.strategy == "D2H2"
    assert h.forward_flop == pytest.approx(18.5e9, rel=0.01)  # REFERENCE.md, W = 128
    assert h.pflops(h.fixed) == pytest.approx(
        3 * h.forward_flop * h.fixed.samples_per_s / 1e15)
    assert h.over_node(h.fixed, h.node_fixed) == pytest.approx(
        h.fixed.samples_per_s / h.node_fixed.samples_per_s)
    assert projection.forward_flop(512) == pytest.approx(64 * h.forward_flop, rel=0.01)


def test_ring_variant_only_changes_latency(v100):
    machine = v100[0].machine
    ring = projection.ring_latency(machine)
    alpha = machine.inter.p2p.a
    for link, base in ((ring.intra, machine.intra), (ring.inter, machine.inter)):
        for kind, factor in (("allreduce", 2), ("allgather", 1), ("reduce_scatter", 1)):
            for p in (2, 64, 512):
                assert link.collectives[kind][p].a == pytest.approx(
                    factor * (p - 1) * base.p2p.a)
                assert link.collectives[kind][p].b == base.collectives[kind][p].b
        assert link.collectives["alltoall"] == base.collectives["alltoall"]
    # the preset itself is untouched and pays a tree: 2 log2 p steps per allreduce
    assert machine.inter.collectives["allreduce"][512].a == pytest.approx(
        2 * math.log2(512) * alpha)
    nbytes = 4 * 9.4e6
    for p in (2, 64, 512):
        tree_s = machine.inter.collective("allreduce", p, nbytes, 2)
        ring_s = ring.inter.collective("allreduce", p, nbytes, 2)
        assert ring_s >= tree_s > 0 and (ring_s > tree_s) == (p > 2)


def test_network_variants_use_one_gpus_share(v100):
    machine = v100[0].machine
    node_bw = 1 / machine.inter.p2p.b
    assert node_bw == pytest.approx(2 * 12.5e9 * 0.8)  # the node's 2 x EDR
    narrow = projection.per_gpu_network(machine)
    assert 1 / narrow.inter.p2p.b == pytest.approx(node_bw / 4)
    assert narrow.inter.collectives["allreduce"][64] == projection.Fit(
        machine.inter.collectives["allreduce"][64].a,
        4 * machine.inter.collectives["allreduce"][64].b)
    assert narrow.intra == machine.intra
    halos = projection.network_halos(machine)
    assert halos.intra.p2p.a == machine.inter.p2p.a
    assert 1 / halos.intra.p2p.b == pytest.approx(node_bw / 4)
    assert halos.intra.collectives == machine.intra.collectives
    assert halos.inter == machine.inter
    assert projection.no_overlap(machine).overlap == 0.0 and machine.overlap == 0.5


def _check_tables(text: str) -> None:
    """Every Markdown table row has as many cells as its header."""
    cells = None
    for line in text.splitlines():
        if not line.startswith("|"):
            cells = None
            continue
        count = line.count("|")
        cells = cells or count
        assert count == cells, line


def test_report_renders_and_splices(v100, tmp_path):
    weak = {128: projection.weak_scaling(128, v100, (1, 2))}
    strong = projection.strong_scaling(v100, (1, 2), width=128)
    heads = projection.headline(v100, gpus=8, batch=2, width=128, search=False)
    result = projection.Projection([V100], weak, strong, heads, [], v100, (1, 2))
    text = projection.render(result)
    for heading in ("Preset constants", "Weak scaling at 128^3", "Strong scaling",
                    "Headline"):
        assert heading in text
    assert "1.42 PFLOP/s" in text
    # the constants read back from the preset: 15.7 T x 20%, the node's 20 GB/s, a tree
    # allreduce (2 log2 512 = 18 steps of 15 us), 16 GiB per GPU less the 10% reserve
    assert "| v100-abci | 3.14 T |" in text and "| 15 us, 20 | 270 us (18 alpha) |" in text
    assert "| 16 GiB (14.4) |" in text
    _check_tables(text)

    doc = tmp_path / "PROJECTION.md"
    doc.write_text(f"# Title\n\nprose\n\n{projection.BEGIN}\nold\n{projection.END}\n\nmore\n")
    projection.write_report(text, doc)
    projection.write_report(text, doc)  # idempotent
    written = doc.read_text()
    assert written.startswith("# Title\n\nprose\n") and written.endswith("\nmore\n")
    assert "old" not in written and written.count(projection.BEGIN) == 1
    assert text in written


def test_sensitivity_rows(v100):
    rows = projection.sensitivity(v100[0], nodes=2)
    assert len(rows) == len(projection.variants(v100[0]))
    documented, ring, narrow, slow, halos, serial = rows
    assert all(0 < r.weak128 <= 1 and 0 < r.weak256 <= 1 for r in rows)
    # every variant but the paper's (slower) compute rate is a pessimistic change
    for worse in (ring, narrow, halos, serial):
        assert worse.pflops <= documented.pflops * (1 + 1e-9)
    assert ring.weak128 < documented.weak128  # 2 nodes: ring 2 x 7 steps, tree 2 x 3
    assert narrow.weak128 < documented.weak128
    assert serial.weak128 < documented.weak128
    assert slow.pflops < documented.pflops  # 2.77 < 3.14 TFLOP/s per GPU
    assert slow.weak128 > documented.weak128  # slower compute hides the allreduce better
    assert halos.strong <= documented.strong  # slower halos cannot help strong scaling
    assert halos.weak128 == pytest.approx(documented.weak128)  # N8 has no halos

"""`flashflow bench --suite dataflow`: the parts that need no GPU (the GPU run itself is timed on one)."""
import os

import pytest
import torch

from flashflow.bench import dataflow
from flashflow.dataflow import orders
from flashflow.dataflow.model import H100, Hardware, simulate


@pytest.fixture(scope="module")
def v():
    return dataflow


def test_permutation_runs_the_model_order(v):
    shape = v.gemm_shape((512, 768, 256))
    for spec in v.DEFAULT_ORDERS:
        perm = v.order_permutation(spec, shape)
        assert perm.dtype == torch.int32
        assert sorted(perm.tolist()) == list(range(shape.num_tiles))
        model_order = orders.make_order(spec, shape.tiles_m, shape.tiles_n)
        assert [(t // shape.tiles_n, t % shape.tiles_n) for t in perm.tolist()] == model_order


def test_prediction_uses_the_hardware_slots(v):
    shape = v.gemm_shape((1024, 1024, 512))
    hw = Hardware(num_sms=8, l2_bytes=1 << 20, tiles_per_sm=2)
    p = v.predict(shape, "grouped_m:2", hw, "lru")
    order = orders.make_order("grouped_m:2", 8, 8)
    assert p["read_bytes"] == simulate(shape, order, 1 << 20, 16).read_bytes
    assert H100.num_sms == 132 and H100.l2_bytes == 50 * 2**20


def test_parse_shape(v):
    assert v.parse_shape("8192x4096x1024") == (8192, 4096, 1024)
    with pytest.raises(ValueError, match="MxNxK"):
        v.parse_shape("8192,4096")
    assert v.parse_shape(" 16x32x48 ") == (16, 32, 48)


def test_occupancy(v):
    # 8 warps, 96 KiB of shared memory, 128 registers: shared memory allows 2, registers 2
    assert v.occupancy(128, 96 * 1024, 8, 227 * 1024) == 2
    assert v.occupancy(255, 32 * 1024, 8, 227 * 1024) == 1
    assert v.occupancy(0, 0, 4, 227 * 1024) == 16


NCU_OUTPUT = '''==PROF== Connected to process 4242 (/usr/bin/python3.12)
==PROF== Profiling "gemm_tile_order_kernel" - 0: 0%....50%....100% - 1 pass
==PROF== Disconnected from process 4242
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","python3.12","127.0.0.1","gemm_tile_order_kernel","1","7","(256, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","1,461,714,944"
"0","4242","python3.12","127.0.0.1","gemm_tile_order_kernel","1","7","(256, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","Mbyte","134.22"
'''


def test_parse_ncu_csv(v):
    m = v.parse_ncu_csv(NCU_OUTPUT)
    assert m["dram__bytes_read.sum"] == 1_461_714_944
    assert m["dram__bytes_write.sum"] == pytest.approx(134.22e6)
    with pytest.raises(ValueError, match="no ncu CSV header"):
        v.parse_ncu_csv("==ERROR== The application returned an error code (1)")
    assert v.parse_ncu_csv(NCU_OUTPUT.replace("gemm_tile_order_kernel", "other")) == {}


RAW_PAGE = '''"ID","Process ID","Process Name","Host Name","Kernel Name","dram__bytes_read.sum","dram__bytes_write.sum"
"","","","","","byte","byte"
"0","7","python3","127.0.0.1","gemm_tile_order_kernel","536,870,912","134217728"
'''


def test_parse_ncu_raw_page(v):
    assert v.parse_ncu_csv(RAW_PAGE) == {"dram__bytes_read.sum": 536870912,
                                          "dram__bytes_write.sum": 134217728}


def test_markdown_table(v):
    rows = [{"shape": "8192x8192x8192", "order": "row_major", "measured_read_bytes": 2**30,
             "measured_write_bytes": 2**27, "model_lru": {"read_bytes": 2**31},
             "model_belady": {"read_bytes": 2**29}, "compulsory_read_bytes": 2**28,
             "time_us": 1234.5},
            {"shape": "8192x8192x8192", "order": "snake", "measured_read_bytes": None,
             "measured_write_bytes": None, "model_lru": {"read_bytes": 2**30},
             "model_belady": {"read_bytes": None}, "compulsory_read_bytes": 2**28,
             "time_us": None}]
    table = v.markdown_table(rows).splitlines()
    assert table[0].startswith("| shape (MxNxK) | order | measured read MiB")
    assert table[2] == ("| 8192x8192x8192 | row_major | 1024.0 | 2048.0 | 2.00 | 512.0 | 256.0 "
                        "| 128.0 | 1234 |")
    assert table[3].startswith("| 8192x8192x8192 | snake |  | 1024.0 |  |")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs the Triton kernel on the CPU through TRITON_INTERPRET=1")
def test_kernel_computes_the_gemm_in_any_order(v):
    shape = v.gemm_shape((40, 48, 24), block_m=16, block_n=16, block_k=16, elem_bytes=4)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(40, 24, generator=g)
    b = torch.randn(24, 48, generator=g)
    for spec in ("hilbert", "grouped_m:2"):
        c = torch.full((40, 48), float("nan"))
        v.launch(a, b, c, v.order_permutation(spec, shape), shape, num_warps=4, num_stages=1)
        torch.testing.assert_close(c, a @ b, rtol=1e-4, atol=1e-4)


def test_markdown_table_with_the_partitioned_model(v):
    row = {"shape": "8192x8192x8192", "order": "row_major", "measured_read_bytes": 2**30,
           "measured_write_bytes": 2**27, "model_lru": {"read_bytes": 2**31},
           "model_partitioned": {"read_bytes": 2**30 + 2**29},
           "model_belady": {"read_bytes": 2**29}, "compulsory_read_bytes": 2**28,
           "time_us": 1234.5}
    table = v.markdown_table([row]).splitlines()
    assert "| model / measured | model partitioned read MiB | partitioned / measured |" in table[0]
    assert table[1].count("|") == table[0].count("|")
    assert table[2] == ("| 8192x8192x8192 | row_major | 1024.0 | 2048.0 | 2.00 | 1536.0 | 1.50 "
                        "| 512.0 | 256.0 | 128.0 | 1234 |")


def test_defaults_add_an_out_of_sample_shape_and_order(v):
    assert v.DEFAULT_SHAPES[:2] == ("8192x8192x8192", "4096x16384x4096")
    assert "16384x4096x4096" in v.DEFAULT_SHAPES and "grouped_m:4" in v.DEFAULT_ORDERS


def test_rank_summary(v):
    # measured: a < b < c, c far above; the unified model ties a and b, the partitioned one
    # swaps them (they are 5% apart, so only the pairs with c count)
    def row(order, measured, lru, part):
        return {"shape": "s", "order": order, "measured_read_bytes": measured,
                "model_lru": {"read_bytes": lru}, "model_partitioned": {"read_bytes": part}}
    rows = [row("a", 100, 7, 2), row("b", 105, 7, 1), row("c", 300, 9, 3),
            row("d", None, 1, 1)]
    (entry,) = v.rank_summary(rows)
    assert entry["orders"] == 3
    assert entry["model_lru"]["spearman"] == pytest.approx(3 ** 0.5 / 2)
    assert entry["model_partitioned"]["spearman"] == pytest.approx(0.5)
    assert (entry["model_partitioned"]["pairs_right"], entry["model_partitioned"]["pairs"]) \
        == (2, 2)
    assert "partitioned rho 0.50 (2/2 pairs >10% apart)" in v.rank_lines([entry])


def test_rescore_reruns_both_models(v):
    payload = {"model_hardware": {"num_sms": 4, "l2_bytes": 1 << 20, "tiles_per_sm": 2},
               "kernel": {"block": [128, 128, 64]},
               "results": [{"shape": "1024x1024x512", "order": "hilbert",
                            "measured_read_bytes": 3 << 20, "model_lru": {"read_bytes": 0}}]}
    (row,) = v.rescore(payload, belady=False)
    shape = v.gemm_shape((1024, 1024, 512))
    order = orders.hilbert(8, 8)
    assert row["model_lru"]["read_bytes"] == simulate(shape, order, 1 << 20, 8).read_bytes
    assert row["model_partitioned"]["read_bytes"] == simulate(
        shape, order, 1 << 20, 8, partitions=2, sharing="home", placement="halves",
        drift=1.0, tiles_per_sm=2).read_bytes
    assert row["measured_read_bytes"] == 3 << 20 and row["model_belady"]["read_bytes"] is None
    assert v.partitioned(Hardware(4, 1 << 20, 2)).slots == 8


def test_variant_names(v):
    assert len(v.all_variants()) == 22 and "drift/p2-home-halves" in v.all_variants()
    assert v.variant_kwargs("lockstep/unified-half", 1 << 20) == (1 << 19, {"drift": 0.0})
    assert v.variant_kwargs("drift0.5/p2-far-random", 8) == (8, {"drift": 0.5, "partitions": 2, "sharing": "far",
                                                                  "placement": "random"})
    for bad in ("sideways/unified", "drift/p3-home-halves", "drift2/unified"):
        with pytest.raises(ValueError, match="variant"):
            v.variant_kwargs(bad, 8)


def test_score_variants_matches_the_model(v):
    payload = {"model_hardware": {"num_sms": 4, "l2_bytes": 1 << 20, "tiles_per_sm": 2},
               "kernel": {"block": [128, 128, 64]},
               "results": [{"shape": "1024x1024x512", "order": o, "measured_read_bytes": m}
                           for o, m in (("row_major", 9 << 20), ("hilbert", 3 << 20), ("grouped_m:2", 4 << 20))]}
    seen = []
    (entry,) = v.score_variants(payload, ["lockstep/unified"], workers=1, progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (3, 3)
    (shape,) = entry["shapes"]
    shp = v.gemm_shape((1024, 1024, 512))
    model = [simulate(shp, orders.make_order(o, 8, 8), 1 << 20, 8, tiles_per_sm=2, drift=0.0).read_bytes
             for o in shape["orders"]]
    assert shape["ratios"] == pytest.approx([p / m for p, m in zip(model, (9 << 20, 3 << 20, 4 << 20))])
    table = v.variants_table([entry]).splitlines()
    assert table[0].startswith("| variant | rho 1024x1024x512 | pairs >10% |") and table[2].startswith("| lockstep/unified |")


def test_result_file_reports_and_rescores(v):
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench/results/dataflow-nvidia-h100-80gb-hbm3.json"
    result = json.loads(path.read_text())
    assert result["suite"] == "dataflow"
    text = v.report(result)
    assert "Rank agreement with the measurement" in text and text.count("| 8192x8192x8192 |") == 7

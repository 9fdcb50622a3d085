"""flashflow.bench.offline: compiling for the H100 on a machine without one. Runs in a child
process, since the test session's TRITON_INTERPRET=1 replaces the kernels at import time."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
from offline_child import child_json   # tests/offline_child.py

CHILD = textwrap.dedent("""
    import json, torch
    from flashflow.ops import mlp
    from flashflow.ops.decode import flash_attn_with_kvcache
    from flashflow.bench.offline import compile_offline, pretend_cuda_capability

    out = {}
    # the fused FFN with two configs whose figures the H100 itself reported (the asserts below)
    m, hidden, inter = 1024, 4096, 14336
    x = torch.empty(m, hidden, dtype=torch.bfloat16)
    w1 = torch.empty(2 * inter, hidden, dtype=torch.bfloat16)
    w2 = torch.empty(hidden, inter, dtype=torch.bfloat16)
    ws = mlp.MlpWorkspace(hidden, max_tokens=m, device="cpu")
    for name, cfg in (("tma3n256", mlp.PersistentConfig(128, 128, 256, 64, 8, 3, use_tma=True)),
                      ("ptr3", mlp.PersistentConfig(128, 128, 128, 64, 8, 3, use_tma=False))):
        with pretend_cuda_capability():
            (r,) = compile_offline(lambda: mlp.launch_persistent(x, w1, w2, "swiglu", "multirow", 8, workspace=ws,
                                                                 config=cfg))
        out[name] = [r.registers, r.spill_bytes, r.shared, r.num_warps, r.num_stages]
    # a decode step, through the public op: one kernel per launch, nothing run
    q = torch.empty(1, 1, 32, 128, dtype=torch.float16)
    kc = torch.empty(1, 4096, 8, 128, dtype=torch.float16)
    with pretend_cuda_capability():
        rs = compile_offline(lambda: flash_attn_with_kvcache(q, kc, kc, cache_seqlens=4000, num_splits=4))
    out["decode"] = [[r.name, r.registers, r.shared, r.num_stages] for r in rs]
    # the FT layout and an FP8 cache (all three layouts): they compile for sm90 unspilled, and
    # the FT K tile is loaded as 16-byte pieces (cp.async of 16 bytes)
    from flashflow.ops.decode import quantize_kv_cache
    from flashflow.reference.decode import to_ft_k, to_ft_v
    from flashflow.bench.offline import offline_target, resources_of
    kb = torch.zeros(1, 4096, 8, 128, dtype=torch.bfloat16)
    k8, s8 = quantize_kv_cache(kb)
    qb = torch.empty(1, 1, 32, 128, dtype=torch.bfloat16)
    table = torch.arange(64, dtype=torch.int32).view(1, 64)
    for name, (kc, vc, layout, bt, scale) in {
            "ft": (to_ft_k(kb), to_ft_v(kb), "FT", None, None),
            "fp8": (k8, k8, "NHD", None, s8),
            "fp8 paged": (k8.view(64, 64, 8, 128), k8.view(64, 64, 8, 128), "NHD", table, s8),
            "fp8 ft": (to_ft_k(k8), to_ft_v(k8), "FT", None, s8)}.items():
        with pretend_cuda_capability(), offline_target() as ks:
            flash_attn_with_kvcache(qb, kc, vc, qb[:, :, :8], qb[:, :, :8], cache_seqlens=4000, block_table=bt,
                                    kv_layout=layout, k_scale=scale, v_scale=scale)
        r = resources_of(ks[0])
        ptx = ks[0].asm["ptx"]
        out[f"decode {name}"] = [r.registers, r.spill_bytes, "cp.async.cg.shared.global" in ptx and ", 0x10," in ptx]
    # the grouped split-K FFN kernel: it must compile for sm90, small enough for two programs per
    # SM, as the ungrouped decode kernel runs
    import dataclasses
    x = torch.empty(16, 4096, dtype=torch.bfloat16)
    w1 = torch.empty(2 * 14336, 4096, dtype=torch.bfloat16)
    w2 = torch.empty(4096, 14336, dtype=torch.bfloat16)
    with pretend_cuda_capability():
        cfg = dataclasses.replace(mlp.splitk_config(16, 14336, True, x.device), group=4, BLOCK_N=32)
        rs = compile_offline(lambda: mlp.launch_splitk(x, w1, w2, "swiglu", config=cfg))
    out["grouped"] = [[r.name, r.registers, r.spill_bytes, r.shared, r.num_warps] for r in rs]
    # fp32 takes the pointer path (no TMA) at twice the bytes a stage: the shipped config for
    # M <= 512 must still fit the 227 KB a CTA may have, gated and not
    for gated in (True, False):
        x = torch.empty(256, 4096, dtype=torch.float32)
        w1 = torch.empty((2 if gated else 1) * 14336, 4096, dtype=torch.float32)
        w2 = torch.empty(4096, 14336, dtype=torch.float32)
        ws = mlp.MlpWorkspace(4096, max_tokens=256, device="cpu")
        with pretend_cuda_capability():
            (r,) = compile_offline(lambda: mlp.launch_persistent(x, w1, w2, "swiglu" if gated else "gelu", "seqsplit",
                                                                 8, workspace=ws))
        out[f"fp32 gated={gated}"] = [r.shared, r.fits()]
    print(json.dumps(out))
""")


def test_compiles_for_sm90_without_a_gpu_and_matches_the_h100():
    got = child_json(CHILD)
    # what the H100 reported for the same kernels (n_regs, n_spills·4, shared): identical
    assert got["tma3n256"] == [255, 0, 147512, 8, 3]
    assert got["ptr3"] == [247, 0, 147456, 8, 3]
    (name, regs, shared, stages), = got["decode"]    # the sm90 config: 3 stages, not the interpreter's 1
    assert name == "decode_attention_kernel" and 0 < regs <= 255 and shared > 0 and stages == 3
    for name in ("ft", "fp8", "fp8 paged", "fp8 ft"):
        regs, spill, vector16 = got[f"decode {name}"]
        assert regs <= 255 and spill == 0 and vector16, (name, got[f"decode {name}"])
    (name, regs, spill, shared, warps), (cast, *_) = got["grouped"]
    assert name == "mlp_splitk_grouped_kernel" and cast == "mlp_splitk_cast_kernel"
    # (ptxas spills 16 bytes of stores into an 8-byte stack frame a thread: pinned, so a change shows)
    assert spill == 8 and 2 * regs * warps * 32 <= 65536 and 2 * (shared + 1024) <= 228 * 1024
    assert got["fp32 gated=True"][1] and got["fp32 gated=False"][1], (got["fp32 gated=True"], got["fp32 gated=False"])


def test_refuses_under_the_interpreter():
    from triton import knobs

    from flashflow.bench.offline import offline_target

    if not knobs.runtime.interpret:
        pytest.skip("runs only in the interpreter session")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        with offline_target():
            pass


def test_info_offline_reproduces_the_h100_report():
    """`flashflow info --offline` on this CPU machine gives, row for row, the registers, spills
    and shared memory that `flashflow info` printed on the H100 for every case it reported
    (bench/results/info-nvidia-h100-80gb-hbm3.json), spills included (a cubin's stack frame,
    where ptxas spills, counted as the driver counts it), and reports every kernel the ops
    launch; the cases the H100 report predates give the figures of the recorded offline report
    (bench/results/info-offline-sm90.json, the table of docs/results.md), spills included."""
    from pathlib import Path

    gpu = json.loads((Path(__file__).resolve().parents[2] / "bench/results/info-nvidia-h100-80gb-hbm3.json").read_text())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "flashflow.cli", "info", "--offline", "--json",
                           "--family", "sm90"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert got["compiled"] and got["offline"]

    def key(r):
        return r["op"], r["family"], r.get("case"), r.get("variant"), r["kernel"]

    def figures(r):
        return r["n_regs"], r["n_spills"], r["shared"]

    reported = {r["op"] for r in gpu["rows"]}
    assert reported == {"attention", "decode", "mlp"}
    measured = {key(r): figures(r) for r in gpu["rows"]}
    offline = {key(r): figures(r) for r in got["rows"] if key(r) in measured}
    assert offline == measured
    # every kernel flashflow's ops launch is in the report: the kernels modules' entry points
    # but the dataflow model's probe (bench) and the tile order's ticket map (tests); the Gluon
    # FP8 attention, which no op launches, has an info case of its own (attention-fp8 "gluon d128")
    import importlib
    import pkgutil

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    import flashflow.kernels
    from flashflow.bench.info import OPS

    # (under the interpreter, as CI runs, @triton.jit makes an InterpretedFunction)
    shipped = {name for m in pkgutil.iter_modules(flashflow.kernels.__path__)
               for name, f in vars(importlib.import_module(f"flashflow.kernels.{m.name}")).items()
               if isinstance(f, (JITFunction, InterpretedFunction)) and name.endswith("_kernel")}
    assert "attention_fp8_fwd_kernel" in shipped
    # the sequence-parallel FP8 attention's K statistics at its slice's ends run only with a
    # process group (tests/distributed, tests/gpu/test_gpu_distributed.py)
    shipped -= {"gemm_tile_order_kernel", "mlp_ticket_map_kernel", "attention_k_edge_stats_kernel"}
    assert shipped <= {r["kernel"] for r in got["rows"]}, shipped - {r["kernel"] for r in got["rows"]}
    # and the cases the H100 report predates (new kernel families, the decode merge, the FFN's
    # two-kernel baseline) compile too
    others = [r for r in got["rows"] if key(r) not in measured]
    assert {r["op"] for r in others} >= set(OPS) - reported
    recorded = json.loads((Path(__file__).resolve().parents[2] / "bench/results/info-offline-sm90.json").read_text())
    recorded = {key(r): figures(r) for r in recorded["rows"]}
    for r in others:
        assert r["error"] is None and 0 < r["n_regs"] <= 255, r
        assert r["shared"] <= 232448, r
        assert figures(r) == recorded.get(key(r)), (key(r), figures(r), recorded.get(key(r)))


GLUON_CHILD = textwrap.dedent("""
    import json
    from flashflow.bench.offline import offline_target, pretend_cuda_capability, wgmma_serialized
    from flashflow.bench.ops import attention_fp8, attention_gluon

    out = {}
    cases = attention_gluon.info_cases("sm90") + [c for c in attention_fp8.info_cases("sm90") if "gluon" in c.label]
    for case in cases:
        with pretend_cuda_capability((9, 0)), offline_target(90) as compiled:
            case.launch("cpu")
        out[case.op + " " + case.label] = [n for k in compiled if k is not None for n in wgmma_serialized(k)]
    # the info call (32 tiles) runs the entries without a causal mask in key pieces: their
    # whole-tile form too
    import dataclasses
    from flashflow.tuning.attention_gluon import CONFIGS
    for entry in CONFIGS.shipped_entries("sm90"):
        cfg = CONFIGS.from_entry(entry)
        if cfg.split_last_wave:
            with pretend_cuda_capability((9, 0)), offline_target(90) as compiled:
                attention_gluon._forward("cpu", dataclasses.replace(cfg, split_last_wave=False), entry["head_dim"],
                                         False)
            out[f"attention-gluon d{entry['head_dim']} whole tiles"] = [
                n for k in compiled if k is not None for n in wgmma_serialized(k)]
    print(json.dumps(out))
""")


def test_gluon_kernels_keep_their_wgmmas_asynchronous():
    """Every shipped config of the Gluon attention kernels (bf16, and the FP8 study kernel)
    compiles for sm90 without ptxas serialising its WGMMAs: a WGMMA issued under a branch, a
    store of many registers while one is in flight, or too few registers leave every WGMMA of the
    kernel waited on as soon as issued (ptxas note C7510-C7520), which no test of numbers sees."""
    got = child_json(GLUON_CHILD, timeout=900)
    assert len(got) >= 10
    assert {case: notes for case, notes in got.items() if notes} == {}

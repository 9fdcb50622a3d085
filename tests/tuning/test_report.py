"""`flashflow info` on a CPU machine, and the parts of the resource report that need no GPU."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from flashflow import cli
from flashflow.tuning import AttentionConfig, report

TABLE = json.loads((Path(report.__file__).parent / "attention_fwd.json").read_text())
FAMILIES = [f for f in TABLE if not f.startswith("_")]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path taken without a GPU")

_CONFIG_KEYS = ("head_dim_max", "causal", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


@no_gpu
def test_info_json_without_gpu_lists_every_shipped_config(capsys):
    assert cli.main(["info", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["compiled"] is False
    shipped = [(f, *(e[k] for k in _CONFIG_KEYS), e.get("use_tma", False))
               for f in FAMILIES for e in TABLE[f]]
    listed = [(r["family"], *(r[k] for k in _CONFIG_KEYS), r["use_tma"]) for r in out["rows"]]
    assert listed == shipped
    assert all(r["n_regs"] is None and r["n_spills"] is None and r["shared"] is None
               for r in out["rows"])


@no_gpu
def test_info_table_without_gpu_says_why_figures_are_missing(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert report.NO_GPU in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("family"))
    body = [line.split() for line in lines[header + 2:] if line.strip()]
    assert [row[0] for row in body] == [f for f in FAMILIES for _ in TABLE[f]]
    assert "regs" not in lines[header]  # no column of blanks where nothing was compiled


@no_gpu
def test_info_family_filter(capsys):
    assert cli.main(["info", "--json", "--family", "sm90"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["family"] for r in rows} == {"sm90"} and len(rows) == len(TABLE["sm90"])
    assert cli.main(["info", "--family", "sm99"]) == 2
    assert "sm99" in capsys.readouterr().err


@no_gpu
def test_kernel_resource_report_without_gpu_returns_configs_with_no_figures():
    rows = report.kernel_resource_report()
    assert len(rows) == sum(len(TABLE[f]) for f in FAMILIES)
    assert {"n_regs", "n_spills", "shared", "BLOCK_M", "family", "error"} <= set(rows[0])


# ---------------------------------------------------------------------- the GPU path's pieces


def test_launch_hook_sees_every_launch_and_is_removed_afterwards():
    from triton import knobs

    class LaunchMetadata:  # what Triton's launcher hands its hooks
        def get(self):
            return {"name": "attention_fwd_kernel", "function": 1234, "stream": 0}

    with report._launches() as seen:
        knobs.runtime.launch_enter_hook(LaunchMetadata())
    knobs.runtime.launch_enter_hook(LaunchMetadata())  # after the block: not recorded
    assert seen == [("attention_fwd_kernel", 1234)]


def test_compiled_kernel_is_found_by_its_function_handle(monkeypatch):
    compiled = types.SimpleNamespace(function=77, n_regs=168, n_spills=0)
    jit_fn = types.SimpleNamespace(device_caches={0: ({"key": compiled}, {}, None, None, None)})
    autotuned = types.SimpleNamespace(fn=types.SimpleNamespace(
        device_caches={0: ({"k": types.SimpleNamespace(function=78)}, {}, None, None, None)}))
    module = types.ModuleType("flashflow.kernels._fake")
    module.kernel, module.tuned, module.LOG2E = jit_fn, autotuned, 1.44
    monkeypatch.setitem(sys.modules, "flashflow.kernels._fake", module)

    assert report._compiled_kernel(77) is compiled
    assert report._compiled_kernel(78).function == 78
    assert report._compiled_kernel(79) is None


def test_variants_force_both_tail_split_paths():
    from flashflow.ops.attention import tail_splits

    cfg = AttentionConfig(128, 128, 8, 2, use_tma=True)
    names = [name for name, _, _ in report._variants(cfg, causal=True)]
    assert names == ["main"]
    (_, main, main_kw), (_, split, split_kw) = report._variants(cfg, causal=False)
    assert main.tail_split is False and main_kw == {}
    tiles = -(-report._SEQLEN // cfg.BLOCK_M) * report._HEADS * report._BATCH
    kv_blocks = -(-report._SEQLEN // cfg.BLOCK_N)
    assert split.tail_split is True
    assert tail_splits(tiles, split_kw["num_sms"], kv_blocks) > 1  # the ops really split


def test_gpu_report_rows_cover_every_config_causal_and_code_path(monkeypatch, capsys):
    """The GPU branch with the compile faked: rows, errors and the exit status."""
    def fake_resources(cfg, head_dim, causal, **launch):
        if head_dim == 256 and causal:
            raise RuntimeError("out of resource: shared memory, Required: 262144")
        kernels = [{"kernel": "attention_fwd_kernel", "n_regs": 168, "n_spills": 0, "shared": 1024}]
        if "num_sms" in launch:
            kernels.append({"kernel": "attention_merge_kernel", "n_regs": 40, "n_spills": 0,
                            "shared": 0})
        return kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(report, "interpreting", lambda: False)
    monkeypatch.setattr(report, "gpu_family", lambda device: "sm90")
    monkeypatch.setattr(report, "_resources", fake_resources)

    rows = report.kernel_resource_report()
    expected = []
    for e in TABLE["sm90"]:
        tail = getattr(report._config(e), "tail_split", False)
        for causal in ((False, True) if e["causal"] is None else (e["causal"],)):
            expected.append((e["head_dim_max"], causal, "main"))
            if tail and not causal:
                expected += [(e["head_dim_max"], causal, "tail split")] * 2  # fwd + merge
    assert [(r["head_dim_max"], r["causal"], r["variant"]) for r in rows] == expected
    failed = [r for r in rows if r["error"]]
    assert all(r["head_dim_max"] == 256 and r["causal"] and r["n_spills"] is None for r in failed)
    assert all(r["n_spills"] == 0 for r in rows if not r["error"])

    assert cli.main(["info"]) == (1 if failed else 0)
    out = capsys.readouterr().out
    assert "NVIDIA H100 80GB HBM3" in out and "regs" in out and "spills" in out
    assert "attention_merge_kernel" in out

"""`flashflow info` on a CPU machine, and the parts of the resource report that need no GPU."""
from __future__ import annotations

import json

import pytest
import torch

from flashflow import cli
from flashflow.bench import info
from flashflow.bench.ops import attention as attention_spec
from flashflow.bench.ops import decode as decode_spec
from flashflow.bench.ops import mlp as mlp_spec
from flashflow.tuning import families, table
from flashflow.tuning.attention import AttentionConfig, config_from_entry

TABLE = table("attention")
FAMILIES = families("attention")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path taken without a GPU")

_CONFIG_KEYS = ("head_dim_max", "causal", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


@no_gpu
def test_info_json_without_gpu_lists_every_shipped_config(capsys):
    assert cli.main(["info", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["compiled"] is False
    shipped = [(f, *(e[k] for k in _CONFIG_KEYS), e.get("use_tma", False))
               for f in FAMILIES for e in TABLE[f]]
    attention = [r for r in out["rows"] if r["op"] == "attention"]
    listed = [(r["family"], *(r[k] for k in _CONFIG_KEYS), r["use_tma"]) for r in attention]
    # one row per (config, causal) the config serves: a causal of None is listed as such
    assert listed == shipped
    assert all(r["n_regs"] is None and r["n_spills"] is None and r["shared"] is None
               for r in out["rows"])
    # every op is there, each case once
    assert {r["op"] for r in out["rows"]} == set(info.OPS)
    assert [r["case"] for r in out["rows"] if r["op"] == "decode"] == [c.label for c in decode_spec.info_cases()]
    assert [r["case"] for r in out["rows"] if r["op"] == "mlp"] == [c.label for c in mlp_spec.info_cases()]


@no_gpu
def test_info_table_without_gpu_says_why_figures_are_missing(capsys):
    assert cli.main(["info", "--op", "attention"]) == 0
    out = capsys.readouterr().out
    assert info.NO_GPU in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("family"))
    body = [line.split() for line in lines[header + 2:] if line.strip()]
    assert [row[0] for row in body] == [f for f in FAMILIES for _ in TABLE[f]]
    assert "regs" not in lines[header]  # no column of blanks where nothing was compiled


@no_gpu
def test_info_family_filter(capsys):
    assert cli.main(["info", "--json", "--family", "sm90", "--op", "attention"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["family"] for r in rows} == {"sm90"} and len(rows) == len(TABLE["sm90"])
    assert cli.main(["info", "--family", "sm99"]) == 2
    assert "sm99" in capsys.readouterr().err


def test_info_refuses_an_unknown_op(capsys):
    assert cli.main(["info", "--op", "attention,conv"]) == 2
    err = capsys.readouterr().err
    assert "--op" in err and "conv" in err and "decode" in err


@no_gpu
def test_kernel_resource_report_without_gpu_returns_configs_with_no_figures():
    rows = info.kernel_resource_report(ops="attention")
    assert len(rows) == sum(len(TABLE[f]) for f in FAMILIES)
    assert {"n_regs", "n_spills", "shared", "BLOCK_M", "family", "error", "op"} <= set(rows[0])


def test_cases_reach_every_kernel_class_of_the_decode_and_mlp_ops():
    decode = [c.label for c in decode_spec.info_cases()]
    # the suite's batch-1 shapes, the other head sizes, a paged cache, a large batch
    assert {"b1 s8192 h32/8 d128", "b1 s8192 h32/8 d64", "b1 s8192 h32/8 d256",
            "b1 s8192 h32/8 d128 paged 64", "b64 s4096 h32/8 d128"} <= set(decode)
    assert len(set(decode)) == len(decode)
    from flashflow.bench.mlp_suite import MODELS

    tokens = {int(c.label.split("M=", 1)[1].split()[0]) for c in mlp_spec.info_cases()}
    assert {c.label.split()[-1].split(":")[0] for c in mlp_spec.info_cases()} == {"splitk", "seqsplit", "multirow",
                                                                            "two-kernels"}
    assert min(tokens) == 1 and max(tokens) > 512   # split-K and the persistent kernel's large tiles
    assert {c.label.split()[0] for c in mlp_spec.info_cases()} == {name for name, *_ in MODELS}


def test_variants_force_both_tail_split_paths():
    from flashflow.ops.attention import tail_splits

    cfg = AttentionConfig(128, 128, 8, 2, use_tma=True)
    names = [name for name, _, _ in attention_spec.variants(cfg, causal=True)]
    assert names == ["main"]
    (_, main, main_kw), (_, split, split_kw) = attention_spec.variants(cfg, causal=False)
    assert main.tail_split is False and main_kw == {}
    tiles = -(-attention_spec.SEQLEN // cfg.BLOCK_M) * attention_spec.HEADS * attention_spec.BATCH
    kv_blocks = -(-attention_spec.SEQLEN // cfg.BLOCK_N)
    assert split.tail_split is True
    assert tail_splits(tiles, split_kw["num_sms"], kv_blocks) > 1  # the ops really split


def test_gpu_report_rows_cover_every_config_causal_and_code_path(monkeypatch, capsys):
    """The GPU branch with the compile faked: rows, errors and the exit status."""
    def fake_resources(case):
        if case.op == "attention" and case.columns["head_dim_max"] == 256 and case.columns["causal"]:
            raise RuntimeError("out of resource: shared memory, Required: 262144")
        kernels = [{"kernel": f"{case.op}_kernel", "n_regs": 168, "n_spills": 0, "shared": 1024,
                    "num_warps": 4, "num_stages": 3}]
        if case.columns.get("variant") == "tail split":
            kernels.append({"kernel": "attention_merge_kernel", "n_regs": 40, "n_spills": 0,
                            "shared": 0, "num_warps": 4, "num_stages": 3})
        return kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(info, "interpreting", lambda: False)
    monkeypatch.setattr(info, "gpu_family", lambda device: "sm90")
    monkeypatch.setattr(info, "_gpu_resources", fake_resources)

    rows = info.kernel_resource_report()
    expected = []
    for e in TABLE["sm90"]:
        tail = getattr(config_from_entry(e), "tail_split", False)
        for causal in ((False, True) if e["causal"] is None else (e["causal"],)):
            expected.append((e["head_dim_max"], causal, "main"))
            if tail and not causal and not e.get("bias"):
                expected += [(e["head_dim_max"], causal, "tail split")] * 2  # fwd + merge
    attention = [r for r in rows if r["op"] == "attention"]
    assert [(r["head_dim_max"], r["causal"], r["variant"]) for r in attention] == expected
    # a config's warps stay the table's, also on the merge kernel's row
    merges = [i for i, r in enumerate(attention) if r["kernel"] == "attention_merge_kernel"]
    assert merges and all(attention[i]["num_warps"] == attention[i - 1]["num_warps"] for i in merges)
    assert [r["bias"] for r in attention] == [r["case"].split()[-2] == "bias" if "split" not in r["case"] else False
                                              for r in attention]
    failed = [r for r in rows if r["error"]]
    assert all(r["head_dim_max"] == 256 and r["causal"] and r["n_spills"] is None for r in failed)
    assert all(r["n_spills"] == 0 for r in rows if not r["error"])
    assert [r["case"] for r in rows if r["op"] == "decode"] == [c.label for c in decode_spec.info_cases()]
    assert {r["family"] for r in rows} == {"sm90"}

    assert cli.main(["info"]) == (1 if failed else 0)
    out = capsys.readouterr().out
    assert "NVIDIA H100 80GB HBM3" in out and "regs" in out and "spills" in out
    assert "attention_merge_kernel" in out and "decode_kernel" in out and "mlp_kernel" in out

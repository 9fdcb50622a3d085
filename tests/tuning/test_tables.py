"""The one config reader (flashflow.tuning.ConfigTable): every entry of every table parses, every
lookup returns the first entry that holds under the rule its op has always had, the notes keep
one style, and the launch rules are defined in tuning/ only."""
import ast
import importlib
import itertools
import json
import pkgutil
import re
from pathlib import Path

import pytest

import flashflow.tuning as tuning
from flashflow.tuning import ConfigTable, NoConfigError, holds, table
from flashflow.tuning.attention import CONFIGS as ATTENTION, AttentionConfig, attention_config
from flashflow.tuning.attention_bwd import AttentionBwdConfig, attention_bwd_config
from flashflow.tuning.attention_fp8 import AttentionFp8Config, attention_fp8_config
from flashflow.tuning.decode import DecodeConfig, decode_config
from flashflow.tuning import mlp
from flashflow.tuning.mlp import PersistentConfig, SplitKConfig
from flashflow.tuning.norm import heads_per_program, row_warps

ROOT = Path(__file__).resolve().parents[2]
TUNING = ROOT / "flashflow" / "tuning"


def all_tables() -> list[ConfigTable]:
    found = []
    for info in pkgutil.iter_modules([str(TUNING)]):
        module = importlib.import_module(f"flashflow.tuning.{info.name}")
        found += [v for v in vars(module).values() if isinstance(v, ConfigTable)]
    return list(dict.fromkeys(found))


def test_every_json_file_and_sub_table_has_a_reader():
    read = {(t.name, t.kind) for t in all_tables()}
    for path in TUNING.glob("*.json"):
        data = table(path.stem)
        kinds = [k for k, v in data.items() if isinstance(v, dict) and any(isinstance(x, list) for x in v.values())]
        assert {(path.stem, k) for k in kinds or [None]} <= read, path.name


@pytest.mark.parametrize("t", all_tables(), ids=lambda t: f"{t.name}-{t.kind or ''}")
def test_every_entry_parses_through_the_one_reader(t):
    assert t.problems() == []
    assert t.families()
    for family in t.families():
        entries = t.entries(family)
        assert entries, family
        for entry in entries:
            cfg = t.from_entry(entry, **dict(t.supplied))
            assert isinstance(cfg, t.cls)
            # every field the entry names is the config's value, none is dropped or renamed
            assert all(getattr(cfg, k) == v for k, v in entry.items() if k in cfg.as_dict())


def test_the_reader_refuses_bad_entries(monkeypatch):
    real = tuning.table

    def fake(name):
        if name != "broken":
            return real(name)
        return {"_doc": "a broken table", "sm90": [
            {"head_dim_max": 64, "causal": None, "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
            {"head_dim_max": 128, "BLOCK_M": 64, "BLOCK_N": "64", "num_warps": 4, "num_stages": 2},
            {"head_dim_max": 128, "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": True, "num_stages": 2},
            {"head_dim_max": 128, "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "stages": 3},
            {"head_dim_max": 256, "BLOCK_M": 64, "num_warps": 4, "num_stages": 2},
            {"head_dim_max": 256, "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "_why": 3},
            {"head_dim_max": 256, "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "_rejected": "x"},
        ]}
    monkeypatch.setattr(tuning, "table", fake)
    t = ConfigTable("broken", AttentionConfig, keys=("head_dim", "causal", "bias"), what="broken")
    found = t.problems()
    assert [p.split(":")[0] for p in found] == [f"broken.json sm90[{i}]" for i in range(1, 7)]
    assert "BLOCK_N='64'" in found[0] and "num_warps=True" in found[1] and "unknown key 'stages'" in found[2]
    assert "BLOCK_N" in found[3] and "_why" in found[4] and "_rejected" in found[5]
    with pytest.raises(ValueError, match="config table problems"):
        t.entries("sm90")


def test_the_match_rule():
    entry = {"head_dim_max": 128, "causal": None, "kv_fp8": True}
    assert holds(entry, {"head_dim": 128, "causal": True, "kv_fp8": True})
    assert holds(entry, {"head_dim": 16, "causal": False, "kv_fp8": True})
    assert not holds(entry, {"head_dim": 129, "causal": False, "kv_fp8": True})     # over the bound
    assert not holds(entry, {"head_dim": 64, "causal": False, "kv_fp8": False})     # unequal
    assert not holds(entry, {"head_dim": None, "causal": False, "kv_fp8": True})    # None passes no bound
    assert holds(entry, {"head_dim": 64, "causal": False, "kv_fp8": True, "bias": True})   # absent: any
    assert holds({}, {"m": 5})


def test_lookup_errors_name_the_op_the_family_and_the_inputs():
    with pytest.raises(NoConfigError, match="no FP8 attention configs for GPU family 'sm80'; family must be one of"):
        attention_fp8_config(128, False, "sm80")
    with pytest.raises(ValueError, match="no attention backward config for head_dim 512 on sm90"):
        attention_bwd_config(512, "sm90")
    with pytest.raises(LookupError, match="mlp plan configs for GPU family 'sm70'"):
        mlp.auto_plan("sm70", True, 1, 14336, 132)
    with pytest.raises(TypeError, match="attention lookups take head_dim, causal, bias"):
        ATTENTION.match("sm90", head_dim=64)


# --------------------------------------------------------------------------------------------
# the lookups return what each op's own loop returned: the first entry that holds under that
# op's rule, written out here once more per op as the oracle
# --------------------------------------------------------------------------------------------

FAMILIES = ("sm90", "sm80", "interpreter")
HEAD_DIMS = (8, 16, 48, 64, 80, 128, 160, 256, 512)


def first(entries, pred):
    return next((e for e in entries if pred(e)), None)


def build(cls, entry, **defaults):
    names = cls.__dataclass_fields__
    return cls(**{**{k: v for k, v in defaults.items() if k in names}, **{k: entry[k] for k in names if k in entry}})


def same(lookup, expected_entry, cls, **defaults):
    if expected_entry is None:
        with pytest.raises(ValueError):
            lookup()
    else:
        assert lookup() == build(cls, expected_entry, **defaults)


def test_attention_lookups_as_their_loops():
    for family, d, causal, bias in itertools.product(FAMILIES, HEAD_DIMS, (False, True), (False, True)):
        entry = first(table("attention")[family], lambda e: d <= e["head_dim_max"] and e["causal"] in (None, causal)
                      and e.get("bias") in (None, bias))
        same(lambda: attention_config(d, causal, family, bias), entry, AttentionConfig)
    for family, d in itertools.product(FAMILIES, HEAD_DIMS):
        entry = first(table("attention_bwd")[family], lambda e: d <= e["head_dim_max"])
        same(lambda: attention_bwd_config(d, family), entry, AttentionBwdConfig)
    for family, d, causal in itertools.product(("sm90", "interpreter"), HEAD_DIMS, (False, True)):
        entry = first(table("attention_fp8")[family], lambda e: d <= e["head_dim_max"] and e["causal"] in (None, causal))
        same(lambda: attention_fp8_config(d, causal, family), entry, AttentionFp8Config)


def test_decode_lookup_as_its_loop():
    rules = table("decode")
    seen = set()
    for family, d, programs, num_sms, seqlen, splits, page, fp8 in itertools.product(
            FAMILIES, (64, 128, 256), (1, 16, 17, 132, 133, 512), (132, 108), (0, 1024, 2048, 8192), (0, 1, 2),
            (None, 8, 16, 24, 32, 64), (False, True)):
        long_stream = splits in (0, 1) and programs > num_sms and seqlen >= rules["long_stream"]["min_seqlen_k"]
        entry = first(rules[family], lambda e: d <= e["head_dim_max"] and e.get("long_stream") in (None, long_stream)
                      and e.get("kv_fp8") in (None, fp8) and programs <= e.get("programs_max", programs))
        cfg = DecodeConfig(entry["BLOCK_N"], entry["num_warps"], entry["num_stages"])
        small = rules["small_pages"]
        if page is not None and small["min_page"] <= page < cfg.BLOCK_N and page & (page - 1) == 0:
            cfg = DecodeConfig(page, cfg.num_warps, cfg.num_stages + small["extra_stages"])
        got = decode_config(family, d, programs=programs, num_sms=num_sms, max_seqlen_k=seqlen, num_splits=splits,
                            page_size=page, kv_fp8=fp8)
        assert got == cfg, (family, d, programs, num_sms, seqlen, splits, page, fp8)
        seen.add(id(entry))
    # the grid reaches every entry of the table
    assert seen == {id(e) for f in FAMILIES for e in rules[f]}


def _mlp_first(kind, family, **keys):
    def holds_for(key, want, got):   # mlp.py's _holds: m_max a bound, other keys equal
        return got is not None and got <= want if key == "m_max" else got == want

    def ok(e):
        return all(k not in e or holds_for(k, e[k], keys.get(k)) for k in ("gated", "slice", "m_max", "dtype"))
    return first(table("mlp")[kind][family], ok)


def test_mlp_lookups_as_their_loop():
    seen = set()
    for family, gated, inter, sms in itertools.product(FAMILIES, (True, False), (96, 8192, 14336, 28672, 65536),
                                                       (132, 108, 4)):
        width = mlp.slice_width(inter, sms)
        for m in (0, 1, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 512, 513, 2048, 2049, 5000):
            plan = _mlp_first("plan", family, gated=gated, slice=width, m_max=m)
            assert mlp.auto_plan(family, gated, m, inter, sms) == plan["plan"]
            split = _mlp_first("splitk", family, gated=gated, slice=width, m_max=m)
            assert mlp.splitk_config(family, gated, m, inter, sms) == build(SplitKConfig, split, BLOCK_I=width)
            seen |= {id(plan), id(split)}
    for family, gated, m, dtype in itertools.product(FAMILIES, (True, False), (None, 0, 64, 128, 129, 512, 513, 4096),
                                                     (None, "float16", "bfloat16", "float32")):
        entry = _mlp_first("persistent", family, gated=gated, m_max=m, dtype=dtype)
        assert mlp.persistent_config(family, gated, m, dtype) == build(PersistentConfig, entry)
        seen.add(id(entry))
    assert seen == {id(e) for kind in ("plan", "splitk", "persistent") for f in FAMILIES for e in table("mlp")[kind][f]}


# --------------------------------------------------------------------------------------------
# one note style
# --------------------------------------------------------------------------------------------

MAX_NOTE = 300
HISTORY = re.compile(r"\b(previous(ly)?|earlier|now|used to|this session|(first|second|third|last) run|"
                     r"so the code was removed|no longer|anymore)\b", re.I)


def _entries_and_rules(data: dict, where: str):
    """(where, dict, is an entry) of every entry in a family list and every rule-parameter dict."""
    for key, value in data.items():
        if key.startswith("_"):
            continue
        if isinstance(value, list):
            yield from ((f"{where} {key}[{i}]", e, True) for i, e in enumerate(value))
        elif any(isinstance(v, list) for v in value.values()):
            yield from _entries_and_rules(value, f"{where} {key}")
        else:
            yield f"{where} {key}", value, False


def _own_notes(obj: dict, where: str):
    for key, value in obj.items():
        if key == "_rejected":
            for option, reason in value.items():
                yield f"{where} _rejected[{option!r}]", reason
        elif key.startswith("_"):
            yield f"{where} {key}", value


def _notes(data: dict, where: str):
    yield from _own_notes(data, where)
    for place, obj, _ in _entries_and_rules(data, where):
        yield from _own_notes(obj, place)


def _cited(note: str) -> list[str]:
    return [w.strip("(),;.`") for w in note.split() if w.strip("(),;.`").endswith(".json")]


def _expand(name: str) -> list[str]:
    """The names a citation stands for: ``a-{b,c}-*.json`` is a-b-*.json and a-c-*.json."""
    m = re.search(r"\{([^}]*)\}", name)
    if not m:
        return [name]
    return [x for alt in m.group(1).split(",") for x in _expand(name[:m.start()] + alt + name[m.end():])]


@pytest.mark.parametrize("name", sorted(p.stem for p in TUNING.glob("*.json")))
def test_config_notes_keep_one_style(name):
    data = table(name)
    assert isinstance(data.get("_doc"), str) and data["_doc"], f"{name}.json has no _doc"
    for place, obj, _ in _entries_and_rules(data, name):
        assert isinstance(obj.get("_why"), str) and obj["_why"].strip(), f"{place} has no _why"
    notes = list(_notes(data, name))
    for place, note in notes:
        assert isinstance(note, str) and note.strip(), place
        assert len(note) <= MAX_NOTE, f"{place}: {len(note)} characters, at most {MAX_NOTE}"
        assert not HISTORY.search(note), f"{place} speaks of history: {HISTORY.search(note).group(0)!r}"
        for cited in _cited(note):
            for pattern in _expand(cited):
                base = ROOT if "/" in pattern else ROOT / "bench" / "results"
                found = sorted(base.glob(pattern))
                assert found, f"{place} cites {cited}: no such file"
                for path in found:
                    json.loads(path.read_text())


def test_rejected_options_sit_on_the_entry_they_lost_to():
    for name in (p.stem for p in TUNING.glob("*.json")):
        data = table(name)
        assert "_rejected" not in data, f"{name}.json: move each rejected option to the entry it lost to"
        for place, obj, _ in _entries_and_rules(data, name):
            rejected = obj.get("_rejected", {})
            assert isinstance(rejected, dict) and all(isinstance(k, str) and k for k in rejected), place


# --------------------------------------------------------------------------------------------
# launch rules: defined in tuning/, imported by ops/
# --------------------------------------------------------------------------------------------

RULES = {"attention": ("tail_splits",), "attention_bwd": ("DELTA_ROWS",), "decode": ("num_splits_heuristic",),
         "mlp": ("slice_width", "chunk_n"), "norm": ("row_warps", "heads_per_program")}


def test_launch_rules_are_defined_in_tuning_only():
    defined = {}
    for path in sorted((ROOT / "flashflow" / "ops").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                defined.setdefault(node.name, []).append(path.name)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id.isupper():
                        defined.setdefault(target.id, []).append(path.name)
    for module, names in RULES.items():
        mod = importlib.import_module(f"flashflow.tuning.{module}")
        for name in names:
            assert hasattr(mod, name), f"flashflow.tuning.{module} lacks {name}"
            assert name not in defined, f"{name} is defined in flashflow/ops/{defined.get(name)}; it belongs in tuning"
    for alias in ("_num_warps", "_heads_per_program"):
        assert alias not in defined, f"{alias} is defined in flashflow/ops/{defined[alias]}"
    from flashflow.ops import attention, attention_bwd, decode, norm
    assert attention.tail_splits is importlib.import_module("flashflow.tuning.attention").tail_splits
    assert decode.num_splits_heuristic is importlib.import_module("flashflow.tuning.decode").num_splits_heuristic
    assert attention_bwd.DELTA_ROWS == importlib.import_module("flashflow.tuning.attention_bwd").DELTA_ROWS
    assert norm._num_warps is row_warps and norm._heads_per_program is heads_per_program


def test_norm_launch_rules():
    for block in (1, 64, 256, 1024, 3072, 4096, 16384):
        warps = row_warps(block)
        assert 1 <= warps <= 8 and (warps == 8 or block < 256 * (warps + 1))
    for heads in range(1, 70):
        for most in (1, 4, 16, 64):
            block = heads_per_program(heads, most)
            padded = -(-heads // block) * block
            assert block & (block - 1) == 0 and block <= most
            assert block == 1 or 8 * (padded - heads) <= padded      # at most 1/8 of the lanes masked
    assert heads_per_program(24, 32) == 8


def test_grouped_splitk_chunks():
    for hidden in (96, 4096, 8192, 5000):
        for group in (2, 4, 8):
            for block_n in (16, 32, 64, 128):
                chunk = mlp.chunk_n(hidden, group, block_n)
                assert chunk % block_n == 0 and chunk * group >= hidden
                assert -(-hidden // chunk) <= group                      # at most `group` items per group
                assert chunk - block_n < -(-hidden // group)            # no whole step more than needed

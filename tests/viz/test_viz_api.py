import json
import urllib.error
import urllib.request

import pytest

from flashflow.dataflow import orders
from flashflow.dataflow.model import simulate
from flashflow.dataflow.shape import GemmShape
from flashflow.viz import api
from flashflow.viz.server import serve_in_thread

REQ = {"shape": {"M": 512, "N": 512, "K": 256, "block_m": 128, "block_n": 128, "block_k": 64,
                 "elem_bytes": 2}, "cache_bytes": 96 * 1024, "num_sms": 1, "policy": "lru"}
SHAPE = GemmShape(512, 512, 256, 128, 128, 64, 2)


def test_simulate_path_matches_the_model():
    path = [[0, 0], [0, 1], [1, 1], [1, 0]]
    res = api.simulate_path({**REQ, "path": path})
    t = simulate(SHAPE, [tuple(p) for p in path], 96 * 1024, 1, "lru", record=True)
    assert res["totals"]["read_bytes"] == t.read_bytes
    assert res["totals"]["dram_bytes"] == t.dram_bytes
    assert [s["cum_dram_bytes"] for s in res["steps"]] == [r.cum_dram_bytes for r in t.steps]
    assert res["grid"] == {"tiles_m": 4, "tiles_n": 4, "k_steps": 4}
    assert res["steps"][0]["cache"]["A"][0] + res["steps"][0]["cache"]["B"][0] == \
        res["steps"][0]["cache_blocks"]
    empty = api.simulate_path({**REQ, "path": []})
    assert empty["steps"] == [] and empty["totals"]["dram_bytes"] == 0


def test_named_order_and_search():
    res = api.named_order({**REQ, "spec": "grouped_m:2"})
    assert res["path"] == [list(t) for t in orders.grouped_m(4, 4, 2)]
    small = {**REQ, "shape": {**REQ["shape"], "M": 384, "N": 384, "K": 64},
             "cache_bytes": 64 * 1024}
    found = api.search_order(small)
    assert found["method"] == "exhaustive"
    assert found["read_bytes"] <= found["worst_read_bytes"]
    annealed = api.search_order({**small, "method": "anneal", "iterations": 30, "seed": 2})
    assert annealed == api.search_order({**small, "method": "anneal", "iterations": 30,
                                         "seed": 2})


@pytest.mark.parametrize("bad,message", [
    ({"shape": None}, "shape must be an object"),
    ({"shape": {**REQ["shape"], "M": "x"}}, "M must be an integer"),
    ({"shape": {**REQ["shape"], "M": 65536, "block_m": 16}}, "at most 1024 tiles"),
    ({"policy": "fifo"}, "policy"),
    ({"num_sms": 0}, "num_sms"),
    ({"path": [[9, 9]]}, "outside"),
    ({"path": [[0, 0], [0, 0]]}, "twice"),
])
def test_bad_requests(bad, message):
    with pytest.raises(ValueError, match=message):
        api.simulate_path({**REQ, "path": [], **bad})


@pytest.fixture(scope="module")
def server_url():
    server, url = serve_in_thread()
    yield url
    server.shutdown()
    server.server_close()


def _post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def test_http_server(server_url):
    assert server_url.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(server_url, timeout=10) as resp:
        assert b"Dataflow explorer" in resp.read()
    for name in ("app.js", "style.css"):
        with urllib.request.urlopen(server_url + "static/" + name, timeout=10) as resp:
            assert resp.status == 200
    with urllib.request.urlopen(server_url + "api/orders", timeout=10) as resp:
        names = [o["name"] for o in json.loads(resp.read())["orders"]]
    assert "grouped_m" in names and "hilbert" in names
    res = _post(server_url + "api/simulate", {**REQ, "path": [[0, 0], [1, 1]]})
    assert res["totals"]["read_bytes"] == simulate(SHAPE, [(0, 0), (1, 1)], 96 * 1024).read_bytes


@pytest.mark.parametrize("path,status", [("static/../api.py", 404), ("nope", 404)])
def test_http_not_found(server_url, path, status):
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(server_url + path, timeout=10)
    assert e.value.code == status


def test_http_bad_request(server_url):
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(server_url + "api/simulate", {**REQ, "policy": "fifo"})
    assert e.value.code == 400 and "policy" in json.loads(e.value.read())["error"]
    req = urllib.request.Request(server_url + "api/simulate", data=b"{not json")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400


def test_search_on_a_large_grid_stays_bounded(monkeypatch):
    monkeypatch.setattr(api, "MAX_ANNEAL_WORK", 256 * 8 * 5)   # room for 5 iterations
    req = {"shape": {"M": 2048, "N": 2048, "K": 2048}, "cache_bytes": 4 << 20, "num_sms": 16,
           "method": "anneal", "iterations": 10_000}
    res = api.search_order(req)
    assert res["search_block_k"] == 256                  # 8 K-steps per evaluation
    assert res["iterations"] == 5
    shape = GemmShape(2048, 2048, 2048)
    order = [tuple(t) for t in res["path"]]
    assert simulate(shape, order, 4 << 20, 16).read_bytes == res["read_bytes"] \
        <= res["start_read_bytes"]


@pytest.mark.parametrize("argv,message", [
    (["--port", "70000"], "argument --port: must be in [0, 65535] (0 picks a free port), got 70000"),
    (["--port=-1"], "argument --port: must be in [0, 65535]"),
    (["--port", "web"], "argument --port: must be an integer, got 'web'"),
])
def test_viz_bad_port_is_a_usage_error(argv, message, capsys):
    from flashflow.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["viz", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"flashflow viz: error: {message}" in err and "Traceback" not in err


def test_viz_port_in_use_is_a_usage_error(server_url, capsys):
    from flashflow.cli import main
    port = server_url.rstrip("/").rsplit(":", 1)[1]
    with pytest.raises(SystemExit) as exc:
        main(["viz", "--port", port])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"flashflow viz: error: cannot serve on 127.0.0.1:{port}: " in err
    assert "Traceback" not in err

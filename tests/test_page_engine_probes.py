"""What an attacker on the LAN tried against the status page's login, and what a deployment tried against engine
bundles that no longer fit it: each test is one probe that got through before its fix.

* a wrong token sent as ``Authorization: Bearer`` on any route was not counted by the login's limit
  (``server.login_attempts_per_minute``), so the limit stopped no guesser;
* only the page said ``X-Content-Type-Options: nosniff``; the JSON routes that echo a client's text did not;
* a bundle built for another ``cache.kv_dtype`` was loaded (``engines.engine_dir`` at the bundle) and failed at the
  first frame with onnxruntime's "Failed to find input name ... k_codes", or refused as "differs — ." naming nothing;
* a bundle copied into the engine cache under another folder name was refused as "differs — ." though it fits;
* an engine file replaced by one of the same size ran without a word (only the size was checked);
* ``edgekv build`` called a bundle with a truncated file "up to date", so the rebuild command a refusal printed
  rebuilt nothing.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from edgekv.engines.manifest import BuildKey, EngineError, EngineMismatchError, Manifest, locate
from helpers_server import RunningDaemon, call, server_config

TOKEN = "s3cret-token"


# ---------------------------------------------------------------------------------------------- the page's login
def test_wrong_bearer_tokens_count_against_the_login_limit(tiny_checkpoint, tmp_path):
    """Before: 30 wrong bearer tokens in a row were 30 401s, and ``GET /`` with a bearer answered the page for the
    right one and the login form for a wrong one: an unlimited oracle beside the limited login form."""
    pytest.importorskip("fastapi")
    config = server_config(tiny_checkpoint, token=TOKEN, login_attempts_per_minute=3)
    with RunningDaemon(config, tmp_path / "out.txt", pairs=0) as running:
        statuses = [call(running.port, "GET", "/v1/models", headers={"Authorization": f"Bearer guess-{i}"})[0]
                    for i in range(6)]
        assert statuses[:3] == [401, 401, 401] and statuses[3:] == [429, 429, 429], statuses
        status, headers, _ = call(running.port, "GET", "/", headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 429 and headers.get("retry-after"), status  # the right one is not checked while limited
        status, _, _ = call(running.port, "POST", "/v1/edgekv/login", {"token": TOKEN})
        assert status == 429  # one bucket for the form and the header: guesses do not get twice the rate
        assert call(running.port, "GET", "/healthz")[0] in (200, 503)  # no token sent: nothing is limited


def test_every_answer_says_nosniff(tiny_checkpoint, tmp_path):
    """Before: only ``/`` sent ``X-Content-Type-Options: nosniff``; the JSON routes, the guard's own refusals and
    the health fast path did not."""
    pytest.importorskip("fastapi")
    config = server_config(tiny_checkpoint, token=TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with RunningDaemon(config, tmp_path / "out.txt") as running:
        answers = {
            "page": call(running.port, "GET", "/"),
            "status": call(running.port, "GET", "/v1/edgekv/status", headers=auth),
            "frame": call(running.port, "GET", "/frame.jpg", headers=auth),
            "404 echoing the path": call(running.port, "GET", "/<script>alert(1)</script>", headers=auth),
            "401 from the guard": call(running.port, "GET", "/v1/alerts"),
            "healthz fast path": call(running.port, "GET", "/healthz"),
            "alert echoing its name": call(running.port, "POST", "/v1/alerts",
                                           {"question": "Was there <b>x</b>?", "name": "<script>x</script>"}, auth),
        }
    missing = {name: (status, headers.get("content-type")) for name, (status, headers, _) in answers.items()
               if headers.get("x-content-type-options") != "nosniff"}
    assert not missing, missing
    assert all(headers.get("content-type") for status, headers, _ in answers.values())


# ---------------------------------------------------------------------------------------------- engine bundles
def _bundle(root: Path, key: BuildKey, model_dir: Path, name: str | None = None) -> Path:
    """A bundle of ``key`` with one small engine file, its size and sha256 in the manifest."""
    bundle = root / name if name else key.bundle_dir(root, model_dir.name)
    bundle.mkdir(parents=True)
    data = b"an engine file"
    (bundle / "llm.onnx").write_bytes(data)
    files = {"llm": {"file": "llm.onnx", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
    Manifest(key=key.fields(), model_dir=str(model_dir), files=files).write(bundle)
    return bundle


KEY = dict(backend="onnxruntime", model_hash="ab" * 32, grid_thw=(1, 8, 8), cache_tokens=400, dtype="fp32",
           max_chunk_tokens=256)


def test_a_bundle_for_another_cache_kv_dtype_is_refused_naming_it(tmp_path):
    model = tmp_path / "ckpt"
    floats = BuildKey(**KEY)
    bundle = _bundle(tmp_path / "engines", floats, model)
    int8 = BuildKey(**KEY, kv_dtype="int8")
    with pytest.raises(EngineMismatchError, match=r"cache\.kv_dtype.*built for None, this deployment has 'int8'"):
        locate(bundle, model, int8, "rebuild")  # engine_dir at the bundle: it was loaded
    with pytest.raises(EngineMismatchError, match=r"differs — cache storage .*cache\.kv_dtype"):
        locate(tmp_path / "engines", model, int8, "rebuild")  # the cache: "differs — ." named nothing


def test_a_bundle_renamed_in_the_engine_cache_is_used_when_its_manifest_fits(tmp_path):
    model = tmp_path / "ckpt"
    key = BuildKey(**KEY)
    bundle = _bundle(tmp_path / "engines", key, model, name="copied-from-the-build-host")
    found, manifest = locate(tmp_path / "engines", model, key, "rebuild")
    assert found == bundle and manifest.key == key.fields()


def test_an_engine_file_replaced_by_one_of_the_same_size_is_refused(tmp_path):
    model = tmp_path / "ckpt"
    key = BuildKey(**KEY)
    bundle = _bundle(tmp_path / "engines", key, model)
    assert locate(tmp_path / "engines", model, key, "rebuild")[0] == bundle  # its digest now remembered
    (bundle / "llm.onnx").write_bytes(b"AN ENGINE FILE")  # same size, other bytes
    with pytest.raises(EngineError, match=r"llm\.onnx: engine file's sha256 is not the one in .*manifest.*rebuild"):
        locate(tmp_path / "engines", model, key, "rebuild")


def test_build_rebuilds_a_bundle_with_a_damaged_file(tiny_checkpoint, tmp_path, monkeypatch):
    """The export stubbed (what is checked is the up-to-date decision, not the graphs)."""
    pytest.importorskip("onnx")
    from helpers_checkpoints import stub_graph_exports

    from edgekv.config import EdgeKVConfig
    from edgekv.engines.build import build

    exported = stub_graph_exports(monkeypatch)
    model = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, model)
    config = EdgeKVConfig().with_overrides(
        model={"path": str(model), "dtype": "fp32", "device": "cpu"}, video={"resolution": [112, 112]},
        cache={"max_tokens": 400, "text_reserve_tokens": 96}, engines={"engine_dir": str(tmp_path / "engines")})
    bundle, _ = build(config, progress=False)
    assert exported == ["vision", "llm"]
    build(config, progress=False)
    assert exported == ["vision", "llm"]  # a whole bundle is left alone
    data = (bundle / "llm.onnx").read_bytes()
    (bundle / "llm.onnx").write_bytes(data[: len(data) // 2])
    build(config, progress=False)
    assert exported == ["vision", "llm", "vision", "llm"]  # was "up to date"
    key_dir, _ = locate(tmp_path / "engines", model, _key_of(bundle), "rebuild")
    assert key_dir == bundle


def _key_of(bundle: Path) -> BuildKey:
    fields = Manifest.read(bundle).key
    return BuildKey(**{**fields, "grid_thw": tuple(fields["grid_thw"])})

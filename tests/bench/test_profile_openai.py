"""``gpuslice profile openai:URL`` (issue 52, point 5) against the fake OpenAI-style replica
(``gpuslice.adapters.http.fake_llm``, a process) over real HTTP on 127.0.0.1: streamed chat
completions at a few concurrencies give a generative profile row close to the fake engine's
own speeds, which ``gpuslice plan --gen-profiles`` then plans with."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from gpuslice.adapters.http.fake_llm import EngineSpec
from gpuslice.adapters.profiles.files import read_generative_profiles
from gpuslice.bench.openai_profile import write_row
from gpuslice.cli import main
from gpuslice.core.generative import GenerativePoint
from tests.router.test_router_openai import llm


def _argv(port: int, out: Path, *more: str) -> list[str]:
    return ["profile", f"openai:http://127.0.0.1:{port}/v1", "--model", "m", "--gpu",
            "A100-80GB", "--slice", "mig:3", "--out", str(out), *more]


def test_a_fake_replica_measured_and_planned_with(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gen.csv"
    with llm("m", "--slice", "3g") as port:
        rc = main(_argv(port, out, "--concurrency", "1,4", "--warmup-s", "0.3",
                        "--window-s", "2.5", "--prompt-tokens", "400", "--output-tokens",
                        "20"))
    text = capsys.readouterr().out
    assert rc == 0 and f"wrote {out}" in text, text
    (row,) = read_generative_profiles(out)
    spec = EngineSpec.for_slice("3g")
    assert (row.model, row.gpu, row.slice_kind, row.slice_size) == ("m", "A100-80GB", "mig", 3)
    # the prefill: the prompt over the TTFT less a step, at one stream (the fake's 10,286/s)
    assert 0.5 * spec.prefill_tps < row.prefill_tokens_per_s < 1.5 * spec.prefill_tps, row
    # the decode: at most 4 sequences, each step no faster than the fake's (12 ms + 0.1 ms
    # per sequence), and not slower than three of them
    assert 1 <= row.max_seqs <= 4
    step = spec.step_s + spec.step_per_seq_s * row.max_seqs
    assert 0.9 * step <= row.step_s <= 3 * step, (row.step_s, step)
    svc = tmp_path / "services.yaml"
    svc.write_text("- {name: chat, model: m, rate: 2, slo_ttft_ms: 1000, slo_tpot_ms: 100, "
                   "prompt_tokens: 400, output_tokens: 20}\n")
    assert main(["plan", "--gen-profiles", str(out), "--services", str(svc), "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["valid"] and doc["services"][0]["capacity_rps"] >= 2


def test_a_row_replaces_the_one_of_its_model_gpu_and_slice(tmp_path: Path) -> None:
    out = tmp_path / "gen.csv"
    a = GenerativePoint("m", "A100-80GB", "mig", 3, 1000, 500, 8)
    b = GenerativePoint("m", "A100-80GB", "mig", 1, 300, 100, 4)
    write_row(out, a)
    write_row(out, b)
    write_row(out, GenerativePoint("m", "A100-80GB", "mig", 3, 2000, 600, 8))
    assert [(p.slice_size, p.prefill_tokens_per_s) for p in read_generative_profiles(out)] == \
        [(1, 300), (3, 2000)]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(("drop", "more", "words"), [
    ("--gpu", [], "--gpu is missing: expected the GPU model"),
    ("", ["--slice", "mig:9"], "--slice: expected KIND:SIZE"),
    ("", ["--gpu", "T9000"], "--gpu: expected a GPU model of the catalogue"),
    ("", ["--concurrency", "0"], "--concurrency: expected whole numbers >= 1"),
])
def test_bad_options_are_refused_naming_them_before_any_request(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], drop: str, more: list[str],
        words: str) -> None:
    argv = _argv(_closed_port(), tmp_path / "gen.csv")
    if drop:
        i = argv.index(drop)
        del argv[i:i + 2]
    assert main([*argv, *more]) == 2
    assert words in capsys.readouterr().err


def test_a_batch_profile_in_the_way_and_a_server_that_is_not_there(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    batch = tmp_path / "profiles.csv"
    batch.write_text("model,gpu,slice_kind,slice_size,batch,procs,throughput_rps,latency_ms\n"
                     "tiny,A100-80GB,mig,1,1,1,100,5\n")
    assert main(_argv(_closed_port(), batch)) == 2
    assert "profiles.csv, row 1, field 'prefill_tokens_per_s': missing column" in \
        capsys.readouterr().err
    port = _closed_port()
    assert main(_argv(port, tmp_path / "gen.csv", "--concurrency", "1", "--warmup-s", "0",
                      "--window-s", "0.2")) == 1
    err = capsys.readouterr().err
    assert f"http://127.0.0.1:{port}/v1 did not answer as an OpenAI-compatible server" in err
    assert not (tmp_path / "gen.csv").exists()

"""The benchmark harness end to end, on a tiny saved checkpoint: every mode runs and agrees with jitney."""

from __future__ import annotations

import argparse
import json

import fake_peers
import pytest
import torch
from support import tiny_llama

from jitney.bench.isolation import Peer
from jitney.bench.peers import PEERS
from jitney.bench.run import add_arguments
from jitney.bench.run import main as bench
from jitney.bench.workloads import CHAT_QUESTION, CHAT_QUESTIONS, chat_4, json_16, json_schemas, single_chat
from jitney.cli import main as cli


def test_bench_runs_each_mode_and_writes_json_and_a_plot(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "tiny")
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = cli(["bench", "--model", str(tmp_path / "tiny"), "--workload", "long-prompt", "--max-batch-tokens", "48",
                "--modes", "jitney,jitney-nocache,hf-cb,hf-static,jitney-unfused", "--json", str(out), "--plot", str(png)])
    assert code == 0
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["rows"]] == ["jitney", "jitney-nocache", "hf-cb", "hf-static", "jitney-unfused"]
    for row in report["rows"]:
        assert row["output_tok_s"] > 0
        assert row["same_tokens_as_first"] == 1.0
    assert report["rows"][0]["prompt_tokens_computed"] <= report["rows"][1]["prompt_tokens_computed"]
    assert 0 <= report["rows"][0]["kv_unused_share"] < 0.5
    jitney, cb = report["rows"][0], report["rows"][2]
    assert jitney["vs_hf-cb"] == round(jitney["output_tok_s"] / cb["output_tok_s"], 2) and "vs_hf-cb" not in cb
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    model = tiny_llama()
    assert report["weight_bytes"] == sum(p.numel() * 4 for p in model.parameters()) - model.model.embed_tokens.weight.numel() * 4
    assert report["read_gbps"] > 0 and "weight_read_share" not in jitney  # many requests: not read-bound
    assert 0 < jitney["attainable_share"] and "attainable_share" not in cb and "step_shapes" not in jitney
    for row in (jitney, cb):  # start-up: up to the first request (loading aside); stopping apart from it
        assert 0 < row["startup_s"] < 60 and 0 <= row["shutdown_s"] < 60


def test_a_peer_that_crashes_fails_its_row_and_the_others_are_still_reported(tmp_path, capsys):
    tiny_llama().save_pretrained(tmp_path / "tiny")
    out = tmp_path / "bench.json"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(tmp_path / "tiny"), "--workload", "long-prompt", "--max-batch-tokens", "48",
                              "--modes", "jitney,crashing,fake-q4", "--json", str(out)])
    # fake-q4: llama-cpp-q4's options (repacked, then not) over a peer that crashes when repacking
    peers = {"crashing": Peer(fake_peers.segfaults),
             "fake-q4": Peer(fake_peers.segfaults_when_repacked, PEERS["llama-cpp-q4"].options)}
    assert bench(args, peers) == 0
    jitney, crashed, q4 = json.loads(out.read_text())["rows"]
    assert jitney["mode"] == "jitney" and jitney["output_tok_s"] > 0 and jitney["same_tokens_as_first"] == 1.0
    assert crashed["mode"] == "crashing" and crashed["failed"] == "SIGSEGV" and "SIGSEGV" in crashed["reason"]
    assert "output_tok_s" not in crashed
    assert q4["mode"] == "fake-q4" and q4["wall_s"] == 0.5 and q4["peak_rss_mib"] > 0
    assert q4["note"] == "no repack (repacked run killed by SIGSEGV)"
    table = capsys.readouterr().out.split("\nmode ")[1]
    assert table.splitlines()[1].startswith("jitney ")
    assert "crashing       failed (SIGSEGV): killed by SIGSEGV" in table
    assert "fake-q4: no repack (repacked run killed by SIGSEGV)" in table


def test_the_attainable_bound_is_each_steps_compute_or_its_reads():
    from jitney.bench.profile import FEATURES
    from jitney.bench.run import attainable_seconds, weight_bytes

    model = tiny_llama()
    c = model.config
    linear = sum(p.numel() for n, p in model.model.layers.named_parameters() if p.dim() == 2)
    head_dim = c.hidden_size // c.num_attention_heads
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4

    def step(**f):
        return [float(f.get(name, 0.0)) for name in FEATURES]

    one = step(step=1, query_tokens=1, sampled_rows=1, decode_kv_ktokens=0.1, decode_kv_distinct_ktokens=0.1)
    reads = (weight_bytes(model) + 100 * kv) / 1e9  # at 1 GB/s
    assert attainable_seconds(model, [one], 1e9, 1.0, None) == pytest.approx(reads)  # no compute counted at 1e9 GFLOP/s
    many = step(step=1, query_tokens=256, prefill_attention_mtokens2=0.01)
    flop = 2 * linear * 256 + 4 * c.num_hidden_layers * c.num_attention_heads * head_dim * 1e4
    assert attainable_seconds(model, [many], 1.0, 1e9, None) == pytest.approx(flop / 1e9)  # at 1 GFLOP/s
    assert attainable_seconds(model, [one, many], 1.0, 1.0, None) == pytest.approx(
        max(reads, attainable_seconds(model, [one], 1.0, 1e9, None)) + max(flop / 1e9, weight_bytes(model) / 1e9))
    assert attainable_seconds(model, [one], 1e9, 1.0, "int8") < reads  # a quarter of the weights' bytes
    # a bf16 cache: half the KV bytes
    assert attainable_seconds(model, [one], 1e9, 1.0, None, 2) == pytest.approx((weight_bytes(model) + 50 * kv) / 1e9)
    # bf16 compute: the linears at their own peak, attention at fp32's
    attention = flop - 2 * linear * 256
    assert attainable_seconds(model, [many], 1.0, 1e9, None, linear_gflops=4.0) == pytest.approx(
        (attention + 2 * linear * 256 / 4) / 1e9)


def test_prompt_steps_rate_is_their_operations_over_their_time():
    from jitney.bench.profile import FEATURES
    from jitney.bench.run import prompt_step_rate

    model = tiny_llama()
    c = model.config
    linear = sum(p.numel() for n, p in model.model.layers.named_parameters() if p.dim() == 2)
    head_dim = c.hidden_size // c.num_attention_heads

    def step(**f):
        return [float(f.get(name, 0.0)) for name in FEATURES]

    chunk = step(step=1, query_tokens=256, sampled_rows=2, prefill_attention_mtokens2=0.01)
    flop = (2 * linear * 256 + 2 * c.hidden_size * c.vocab_size * 2
            + 4 * c.num_hidden_layers * c.num_attention_heads * head_dim * 1e4)
    decode = step(step=1, query_tokens=4, sampled_rows=4, decode_kv_ktokens=0.1)
    drafted = step(step=1, query_tokens=200, sampled_rows=40, draft_passes=4, draft_tokens=160)
    steps, rate = prompt_step_rate(model, [decode, chunk, drafted, chunk], [0.5, 2.0, 9.0, 2.0])
    assert steps == 2 and rate == pytest.approx(2 * flop / 4.0 / 1e9)  # (the decode and the drafted step left out)
    assert prompt_step_rate(model, [decode], [0.5]) == (0, 0.0)


def test_bench_runs_jitney_over_a_bf16_or_int8_cache(tmp_path):
    import transformers as T
    from support import scaled_tiny

    # (scaled: rounding the keys and values changes its tokens)
    scaled_tiny(T.LlamaConfig, T.LlamaForCausalLM, num_key_value_heads=2).save_pretrained(tmp_path / "tiny")
    out = tmp_path / "bench.json"
    bench = ["bench", "--model", str(tmp_path / "tiny"), "--workload", "mixed-16", "--json", str(out), "--in-process"]
    assert cli([*bench, "--modes", "jitney,jitney-kvbf16,jitney-kvint8"]) == 0
    plain, bf16, int8 = json.loads(out.read_text())["rows"]
    for row, mode in ((bf16, "jitney-kvbf16"), (int8, "jitney-kvint8")):
        assert row["mode"] == mode and row["output_tok_s"] > 0 and row["attainable_share"] > 0
        assert row["same_tokens_as_first"] < 1
    # every jitney mode over a bf16 cache: jitney's tokens are then jitney-kvbf16's
    assert cli([*bench, "--modes", "jitney-kvbf16,jitney", "--kv-cache-dtype", "bf16"]) == 0
    assert [r["same_tokens_as_first"] for r in json.loads(out.read_text())["rows"]] == [1.0, 1.0]


def test_bench_reads_bf16_computes_shares_against_the_bf16_peak(tmp_path):
    import transformers as T
    from support import scaled_tiny

    scaled_tiny(T.LlamaConfig, T.LlamaForCausalLM, num_key_value_heads=2).save_pretrained(tmp_path / "tiny")
    out = tmp_path / "bench.json"
    assert cli(["bench", "--model", str(tmp_path / "tiny"), "--workload", "mixed-16", "--json", str(out),
                "--modes", "jitney,jitney-bf16c", "--in-process"]) == 0
    report = json.loads(out.read_text())
    plain, bf16 = report["rows"]
    assert (plain["compute"], bf16["compute"]) == ("fp32", "bf16") and bf16["same_tokens_as_first"] < 1
    # each jitney row says what the engine held, by part (`Engine.memory`): bf16 compute's packed copy is smaller
    assert set(plain["memory_mib"]) == {"weights", "packed", "draft", "screen", "kv_reserved", "kv_in_use"}
    assert 0 < bf16["memory_mib"]["packed"] < plain["memory_mib"]["packed"]
    assert report["bf16_matmul_peak_gflops"] > 0 and report["bf16_unit"] in ("portable", "avx512-bf16", "amx")
    gflop, wall = report["workload_gflop"], bf16["wall_s"]
    # (its roofline is not the fp32 one: its linears' share of the work is timed at the bf16 peak)
    assert bf16["roofline_share"] != round(gflop / report["matmul_peak_gflops"] / wall, 3)


def test_bench_gives_one_stream_its_share_of_the_weight_read_limit(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "tiny")
    out = tmp_path / "bench.json"
    assert cli(["bench", "--model", str(tmp_path / "tiny"), "--workload", "single-stream", "--modes", "jitney,jitney-nospec",
                "--json", str(out), "--in-process"]) == 0
    report = json.loads(out.read_text())
    row, plain = report["rows"]
    limit = report["read_gbps"] * 1e9 / report["weight_bytes"]
    assert report["weight_read_limit_tok_s"] == round(limit, 1)
    assert row["weight_read_share"] == round(row["output_tok_s"] / limit, 3)
    # speculative steps by default, none without; the same tokens either way
    assert row["draft_tokens"] > 0 and row["speculative_steps"] > 0 and 0 <= row["draft_accepted_share"] <= 1
    assert plain["draft_tokens"] == 0 and plain["same_tokens_as_first"] == 1.0
    assert row["steps"] < plain["steps"]
    assert 0 < row["ttft_p50_ms"] == row["ttft_mean_ms"] == row["ttft_p99_ms"]  # (one request)


def test_single_chat_is_a_real_question_through_the_chat_template(smollm2):
    _, tokenizer = smollm2
    ((prompt, n),) = single_chat(tokenizer)
    assert n == 128 and CHAT_QUESTION in tokenizer.decode(prompt) and len(prompt) > 20
    four = chat_4(tokenizer)
    assert [n for _, n in four] == [128] * 4
    assert all(q in tokenizer.decode(p) for q, (p, _) in zip(CHAT_QUESTIONS, four, strict=True))


def test_null_executor_times_the_engine_alone(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "tiny")
    out = tmp_path / "overhead.json"
    assert cli(["bench", "--model", str(tmp_path / "tiny"), "--null-executor", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 256 and report["full_decode_steps"] > 100
    assert 0 < report["step_ms_p50"] < 1000


def test_shaped_models_are_built_in_the_dtype_asked():
    from jitney.bench.workloads import shaped_model

    with torch.device("meta"):  # (the shape alone: no memory)
        model = shaped_model("llama3.2-3b-random", torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # (never an fp32 copy on the way)
    assert 3.2e9 < sum(p.numel() for p in model.parameters()) < 3.3e9  # Llama 3.2 3B's, the head tied
    with torch.device("meta"):
        model = shaped_model("mistral-7b-random", torch.bfloat16)
    assert 7.2e9 < sum(p.numel() for p in model.parameters()) < 7.3e9  # Mistral 7B v0.3's, 32,768 tokens
    assert model.config.sliding_window is None  # (full attention: the one-call decoder and speculation serve it)


def test_every_jitney_mode_runs_once_per_eviction_policy_and_a_misspelled_one_is_an_error():
    from jitney.bench.run import runs

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--modes", "jitney,jitney-nolookup,hf-cb", "--eviction", "lru,2q"])
    assert [label for label, _ in runs(args)] == ["jitney[lru]", "jitney[2q]", "jitney-nolookup[lru]",
                                                 "jitney-nolookup[2q]", "hf-cb"]
    args = parser.parse_args(["--modes", "jitney-nolookup"])
    assert [label for label, _ in runs(args)] == ["jitney-nolookup"]
    args = parser.parse_args(["--modes", "jitney-nolookup", "--eviction", "gdsff,lru"])
    with pytest.raises(ValueError, match="unknown eviction policy 'gdsff'; registered: 2q, fifo, lfu, lru, mru"):
        runs(args)


def test_json_16_asks_for_replies_to_schemas_in_its_prompts(smollm2):
    _, tokenizer = smollm2
    work = json_16(tokenizer)
    assert len(work) == 16 and all(n == 256 for _, n in work)
    for (prompt, _), schema in zip(work, json_schemas(16), strict=True):
        assert json.dumps(schema) in tokenizer.decode(prompt)
    assert len({tuple(p) for p, _ in work}) == 16  # (each prompt its own)


def test_the_json_mode_holds_each_reply_to_its_schema_and_times_choosing_tokens(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli(["bench", "--workload", "json-16", "--modes", "jitney-json", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert row["mode"] == "jitney-json" and row["json_share"] == 1.0
    assert 16 <= row["output_tokens"] < 16 * 256  # (each reply ends with its JSON)
    assert row["output_tok_s"] == pytest.approx(row["output_tokens"] / row["wall_s"], rel=0.01)
    assert row["sampling_ms_per_step"] > 0 and row["gflop"] < report["workload_gflop"]  # (its roofline: the tokens it had)
    assert "100% of the replies parse as JSON" in capsys.readouterr().out


def test_the_json_mode_needs_a_tokenizer(tmp_path, capsys):
    tiny_llama().save_pretrained(tmp_path / "tiny")
    assert cli(["bench", "--model", str(tmp_path / "tiny"), "--workload", "long-prompt", "--modes", "jitney,jitney-json"]) != 0
    err = capsys.readouterr().err
    assert "error: jitney-json holds replies to a JSON grammar, which needs a tokenizer" in err


def test_each_jitney_run_is_apart_by_default_and_the_bench_then_holds_only_shapes(tmp_path, monkeypatch):
    from jitney.bench import run

    tiny_llama().save_pretrained(tmp_path / "tiny")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(tmp_path / "tiny"), "--workload", "long-prompt", "--max-batch-tokens", "48",
                              "--modes", "jitney,jitney", "--json", str(tmp_path / "bench.json")])
    held = []
    real = run.load_bench_model
    monkeypatch.setattr(run, "load_bench_model", lambda a, meta=False: held.append(meta) or real(a, meta))
    assert bench(args) == 0
    assert held == [True]  # (this process: shapes alone; each child loads its own weights)
    first, second = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert second["same_tokens_as_first"] == 1.0 and (first["eviction"], first["scheduler"]) == ("mru", "fifo")
    for row in (first, second):  # each child's own start-up and peak, not this process's
        assert 0 < row["startup_s"] < 60 and 0 <= row["shutdown_s"] < 60 and 0 < row["peak_rss_mib"]
    model, _ = real(args, meta=True)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert run.weight_bytes(model) == run.weight_bytes(tiny_llama())


def test_repeated_passes_alternate_their_order_and_report_each_modes_medians(tmp_path):
    from jitney.bench.run import alternated, runs

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--modes", "jitney,jitney-nolookup,hf-cb", "--repeat", "3"])
    order = [(k, label) for k, label, _ in alternated(runs(args), args.repeat)]
    assert order == [(1, "jitney"), (1, "jitney-nolookup"), (1, "hf-cb"), (2, "hf-cb"), (2, "jitney-nolookup"),
                     (2, "jitney"), (3, "jitney"), (3, "jitney-nolookup"), (3, "hf-cb")]
    tiny_llama().save_pretrained(tmp_path / "tiny")
    out = tmp_path / "bench.json"
    assert cli(["bench", "--model", str(tmp_path / "tiny"), "--workload", "long-prompt", "--max-batch-tokens", "48",
                "--modes", "jitney,hf-cb", "--repeat", "2", "--in-process", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["mode"], r["run"]) for r in report["rows"]] == [("jitney", 1), ("hf-cb", 1), ("hf-cb", 2), ("jitney", 2)]
    walls = sorted(r["wall_s"] for r in report["rows"] if r["mode"] == "jitney")
    median = report["medians"]["jitney"]
    assert median["runs"] == 2 and median["wall_s"] == pytest.approx(sum(walls) / 2) and median["wall_s_range"] == walls
    assert all(r["same_tokens_as_first"] == 1.0 for r in report["rows"])
    assert cli(["bench", "--model", str(tmp_path / "tiny"), "--modes", "jitney", "--repeat", "0"]) != 0

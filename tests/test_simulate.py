"""`jitney simulate`: the real scheduler, cache and eviction plugins on a virtual clock, from a model's config
alone; the same prefix hits and prompt tokens as a real run; arrivals honoured; profiles fitted and refused."""

from __future__ import annotations

import random

import anyio
import msgspec
import pytest
from support import flat_head_llama, tiny_llama

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.bench.profile import StepProfile, fit, load_profile
from jitney.bench.simulate import Arrival, Timeline, meta_model, simulate
from jitney.core.hooks import hookimpl

CONSTANT = StepProfile(model="tiny", machine="test", coefficients=[0.01, 0, 0, 0, 0, 0], fit_error=0, total_error=0,
                       steps=0)
SHAPED = StepProfile(model="tiny", machine="test", coefficients=[1e-3, 2e-5, 1e-5, 1e-4, 2e-4, 1e-2], fit_error=0,
                     total_error=0, steps=0)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    tiny_llama().config.save_pretrained(folder)
    return folder / "config.json"


def prefixes_workload(seed: int = 3) -> list[Arrival]:
    """48 requests over 6 shared 24-token prefixes, shuffled: the cache cannot hold every prefix."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 256) for _ in range(24)] for _ in range(6)]
    order = [i % 6 for i in range(48)]
    rng.shuffle(order)
    return [Arrival(systems[k] + [rng.randrange(3, 256) for _ in range(rng.randint(1, 6))], rng.randint(2, 8))
            for k in order]


class CountingLru:
    calls = 0

    def priority(self, block):
        CountingLru.calls += 1
        return block.last_access


class Registers:
    @hookimpl
    def jitney_register_eviction_policies(self, register):
        register("counting-lru", lambda config: CountingLru())


CONFIG = dict(block_size=4, num_blocks=40, max_batch_tokens=32, eviction="counting-lru")


def serve_all(engine: Engine, work: list[Arrival]) -> None:
    """Every request of `work` through a real engine, at once."""

    async def main():
        async with engine, anyio.create_task_group() as tg:
            for a in work:
                tg.start_soon(engine.generate, Request(a.prompt, SamplingParams(max_new_tokens=a.output_tokens,
                                                                                 ignore_eos=True)))

    anyio.run(main)


def real_run(work: list[Arrival]) -> Timeline:
    timeline = Timeline()
    config = EngineConfig(**CONFIG, speculative_tokens=0, lookup_tokens=0)
    serve_all(Engine(tiny_llama(), config=config, plugins=[timeline, Registers()]), work)
    return timeline


def test_a_simulation_runs_the_serving_plugins_and_hits_the_prefixes_a_real_run_hits(tiny_config):
    work = prefixes_workload()
    real = real_run(work)
    CountingLru.calls = 0
    row = simulate(meta_model(str(tiny_config)), work, SHAPED, plugins=[Registers()], **CONFIG)
    assert CountingLru.calls > 0  # the registered policy ranked the simulation's cached blocks
    assert 0 < real.hit < real.query  # some prefixes were evicted, some reused
    assert row["prefix_hit_rate"] == round(real.hit / real.query, 3)
    assert row["prompt_tokens_computed"] == real.prefill
    assert row["steps"] == real.steps
    again = simulate(meta_model(str(tiny_config)), work, SHAPED, plugins=[Registers()], **CONFIG)
    timed = ("simulated_in_s",)  # (this machine's time, not the simulation's)
    assert {k: v for k, v in again.items() if k not in timed} == {k: v for k, v in row.items() if k not in timed}


def test_step_time_noise_is_seeded_and_centred_on_the_prediction(tiny_config):
    """`--seeds` / `--jitter`: each seed's steps are the predictions times a seeded log-normal draw of mean 1, so a
    seed repeats exactly, seeds differ, and the schedule (which steps run) is the engine's own either way."""
    model = meta_model(str(tiny_config))
    work = [Arrival([5, 6, 7, 8], 30), Arrival([9, 10], 30)]
    second = msgspec.structs.replace(CONSTANT, coefficients=[1.0, 0, 0, 0, 0, 0])  # (a second a step)
    plain = simulate(model, work, second, block_size=4, num_blocks=32)
    assert plain["seed"] == 0 and plain["jitter"] == 0
    rows = [simulate(model, work, second, block_size=4, num_blocks=32, seed=s, jitter=0.2) for s in range(8)]
    again = simulate(model, work, second, block_size=4, num_blocks=32, seed=3, jitter=0.2)
    assert again["wall_s"] == rows[3]["wall_s"] and again["itl_p99_ms"] == rows[3]["itl_p99_ms"]
    assert len({r["wall_s"] for r in rows}) == len(rows)
    assert all(r["steps"] == plain["steps"] and r["prompt_tokens_computed"] == plain["prompt_tokens_computed"]
               for r in rows)
    # (31 steps each, a 20% spread a step: the mean of 8 walls lands within a few percent of the prediction)
    assert sum(r["wall_s"] for r in rows) / len(rows) == pytest.approx(plain["wall_s"], rel=0.05)


def test_seeds_give_one_row_each_and_their_spread_defaults_to_the_fit_error(tiny_config, tmp_path, monkeypatch):
    import json

    from jitney.bench import simulate as command_module
    from jitney.cli import main

    noisy = msgspec.structs.replace(SHAPED, fit_error=0.07, steps=100)
    monkeypatch.setattr(command_module, "profile_for", lambda *a, **k: noisy)
    out = tmp_path / "sim.json"
    command = ["simulate", "--model", str(tiny_config), "--workload", "mixed-16", "--eviction", "lru,mru"]
    assert main([*command, "--seeds", "3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["eviction"], r["seed"], r["jitter"]) for r in rows] == [
        (e, s, 0.07) for e in ("lru", "mru") for s in range(3)]
    assert main([*command, "--json", str(out)]) == 0  # one seed: no noise unless asked
    assert {r["jitter"] for r in json.loads(out.read_text())["rows"]} == {0}
    assert main([*command, "--seeds", "0"]) == 2 and main([*command, "--jitter", "1.5"]) == 2


def test_virtual_time_is_the_sum_of_the_predicted_steps_and_arrivals_are_honoured(tiny_config):
    model = meta_model(str(tiny_config))
    row = simulate(model, [Arrival([5, 6, 7], 4)], CONSTANT, block_size=4, num_blocks=16)
    assert row["wall_s"] == pytest.approx(0.01 * row["steps"])
    later = simulate(model, [Arrival([5, 6, 7], 4), Arrival([8, 9], 4, arrival_s=100.0)], CONSTANT,
                     block_size=4, num_blocks=16)
    # the engine idles until the second arrives, which then waits one step for its first token, not 100 s
    assert later["wall_s"] == pytest.approx(100.0 + 0.01 * 4)
    assert later["ttft_p99_ms"] == pytest.approx(10.0) and later["ttft_mean_ms"] == pytest.approx(10.0)


def test_a_profile_fit_recovers_a_non_negative_cost_model():
    rng = random.Random(0)
    truth = [0.004, 5e-4, 0.0, 2e-3, 1e-3, 0.3]
    shapes, seconds = [], []
    for _ in range(200):
        q = [rng.randint(1, 64) if rng.random() < 0.2 else 1 for _ in range(rng.randint(1, 32))]
        ctx = [n + rng.randint(0, 500) for n in q]
        decode_kv = sum(c for n, c in zip(q, ctx) if n == 1)
        shape = [1.0, sum(q), len(q), decode_kv / 1e3, decode_kv * rng.random() / 1e3,  # (distinct: a share)
                 sum(n * c for n, c in zip(q, ctx) if n > 1) / 1e6]
        shapes.append(shape)
        seconds.append(sum(c * x for c, x in zip(truth, shape)))
    coefficients = fit(shapes, seconds)
    assert all(c >= 0 for c in coefficients)
    assert coefficients == pytest.approx(truth, rel=1e-6, abs=1e-9)


def test_profiles_are_fitted_on_relative_errors():
    """A cost the shapes cannot explain: a 10 ms step and a 1 s step of the same shape. Fitted on seconds the
    prediction is their mean, 50 times the short one; weighted by 1 / seconds (as `fit_in_two` fits) the squared
    shares are what is minimised: sum(1 / y) / sum(1 / y**2) = 101 / 10001 s."""
    shapes, seconds = [[1.0], [1.0]], [0.01, 1.0]
    assert fit(shapes, seconds)[0] == pytest.approx(0.505)
    [weighted] = fit(shapes, seconds, weights=[1 / y for y in seconds])
    assert weighted == pytest.approx(101 / 10001, rel=1e-6)


def test_missing_profiles_and_configs_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="jitney calibrate --model nowhere"):
        load_profile(None, "nowhere")
    bad = tmp_path / "profile.json"
    bad.write_text('{"model": 1}')
    with pytest.raises(ValueError, match="not a step-time profile"):
        load_profile(str(bad), "x")
    with pytest.raises(FileNotFoundError, match="no model config"):
        meta_model(str(tmp_path / "missing"))


def test_the_first_simulation_on_a_machine_calibrates_its_profile_once(tiny_config, tmp_path, monkeypatch, capsys):
    from jitney.bench import profile
    from jitney.cli import main

    monkeypatch.setenv("JITNEY_HOME", str(tmp_path))  # a machine with no profile yet
    calibrated = []
    # (a real calibration runs the model for a minute: its result stands in here)
    monkeypatch.setattr(profile, "calibrate_model", lambda model: calibrated.append(model) or SHAPED)
    checkpoint = str(tiny_config.parent)
    simulate_cli = ["simulate", "--model", checkpoint, "--workload", "mixed-16"]
    assert main([*simulate_cli, "--no-calibrate"]) == 2
    assert "no step-time profile" in capsys.readouterr().err and not calibrated
    assert main(simulate_cli) == 0
    said = capsys.readouterr()
    assert calibrated == [checkpoint]
    assert "calibrating it now" in said.err and "sim[fifo/mru]" in said.out
    assert load_profile(None, checkpoint) == SHAPED  # kept where `jitney calibrate` keeps it
    assert main(simulate_cli) == 0
    assert calibrated == [checkpoint] and "calibrating" not in capsys.readouterr().err
    # a config.json alone has no weights to calibrate with
    assert main(["simulate", "--model", str(tiny_config)]) == 2
    assert "no weights to calibrate" in capsys.readouterr().err and calibrated == [checkpoint]


# -- traces ---------------------------------------------------------------------------------------------------


def test_trace_lines_are_checked_and_named_by_number(tmp_path):
    from jitney.bench.traces import read_trace

    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 3}\n\n'
                    '{"arrival_s": 1, "prompt_tokens": 5, "prompt_ids": [1], "output_tokens": 3}\n')
    with pytest.raises(ValueError, match="line 3: give prompt_ids or prompt_tokens"):
        read_trace(path)
    path.write_text('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 3, "colour": "red"}\n')
    with pytest.raises(ValueError, match="line 1: .*colour"):
        read_trace(path)
    path.write_text('{"prompt_tokens": 5, "output_tokens": 0}\n')
    with pytest.raises(ValueError, match="line 1: output_tokens must be >= 1"):
        read_trace(path)


@pytest.mark.parametrize("kind", ["chat-sessions", "agentic", "bursty", "sharegpt"])
def test_generated_traces_round_trip_and_share_what_they_say(kind, tmp_path):
    from jitney.bench.traces import GENERATORS, materialize, read_trace, write_trace

    requests = GENERATORS[kind](200, 5.0, seed=2)
    write_trace(tmp_path / "t.jsonl", requests)
    again = read_trace(tmp_path / "t.jsonl")
    assert again == requests
    arrivals = materialize(again, 49152)
    assert [a.arrival_s for a in arrivals] == sorted(r.arrival_s for r in requests)
    if kind == "chat-sessions":  # a session's next turn starts with the previous turn's prompt
        by_session: dict[str, list] = {}
        for r, a in zip(sorted(again, key=lambda r: r.arrival_s), arrivals):
            by_session.setdefault(r.session, []).append(a.prompt)
        turns = next(p for p in by_session.values() if len(p) > 1)
        assert turns[1][: len(turns[0])] == turns[0] and len(turns[1]) > len(turns[0])
    if kind == "agentic":  # requests of one tool prompt share it
        groups: dict[str, list] = {}
        for r, a in zip(sorted(again, key=lambda r: r.arrival_s), arrivals):
            groups.setdefault(r.prefix_group, []).append(a.prompt[: r.prefix_tokens])
        assert all(all(p == ps[0] for p in ps) for ps in groups.values())


def test_a_recorded_trace_replays_the_served_requests(tmp_path):
    from jitney.bench.traces import materialize, read_trace
    from jitney.plugins.trace import TraceRecorder

    work = prefixes_workload()[:12]
    path = tmp_path / "served.jsonl"
    serve_all(Engine(tiny_llama(), config=EngineConfig(block_size=4, num_blocks=64),
                     plugins=[TraceRecorder(path, token_ids=True)]), work)
    replay = materialize(read_trace(path), 256)
    assert sorted((a.prompt, a.output_tokens) for a in replay) == sorted((a.prompt, a.output_tokens) for a in work)
    assert all(a.arrival_s >= 0 for a in replay)


def test_a_chat_trace_simulates_with_prefix_hits(tiny_config, tmp_path):
    from jitney.bench.traces import chat_sessions, materialize

    work = materialize(chat_sessions(300, 20.0, seed=1), 256)
    row = simulate(meta_model(str(tiny_config)), work, SHAPED, block_size=4, num_blocks=2000, max_batch_tokens=128)
    assert row["prefix_hit_rate"] > 0.3  # later turns reuse their session's context
    assert row["refused"] > 0  # sessions that outgrew the tiny model's 512-token context: refused, as served
    assert row["wall_s"] >= max(a.arrival_s for a in work)


def test_the_schedule_timeline_shows_each_requests_states(tiny_config, tmp_path):
    from jitney.plugins.timeline import DECODE, PREFILL, RESET, WAITING, ScheduleTimeline

    schedule = ScheduleTimeline()
    work = [Arrival([3 + i] * 6, 24) for i in range(8)]  # more than 12 blocks of 4 together: some are reset
    path = tmp_path / "timeline.png"
    row = simulate(meta_model(str(tiny_config)), work, SHAPED, plugins=[schedule], timeline_path=str(path),
                   block_size=4, num_blocks=12, safety_margin=0.0)
    assert row["preemptions"] > 0
    states = [{state for _, _, state in runs} for runs in schedule.rows.values()]
    assert len(states) == 8 and all({WAITING, PREFILL, DECODE} <= s for s in states)
    assert any(RESET in s for s in states)
    assert len(schedule.kv_usage) == row["steps"]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_timeline_shows_what_a_cache_study_reads(tiny_config, tmp_path):
    """Per step: blocks in use and cached, prefix hits and misses, evictions; a time axis; binned columns keep a
    request's prefill (where its misses are) visible over the decodes around it."""
    from jitney.plugins.timeline import DECODE, PREFILL, ScheduleTimeline

    schedule = ScheduleTimeline()
    prefixes = [[10 + k] * 12 for k in range(4)]  # three blocks each; a cache of 12 blocks holds two at most
    work = [Arrival(prefixes[i % 4] + [50 + i], 4, arrival_s=0.05 * i) for i in range(16)]
    row = simulate(meta_model(str(tiny_config)), work, SHAPED, plugins=[schedule], block_size=4, num_blocks=12,
                   safety_margin=0.0)
    steps = row["steps"]
    assert len(schedule.cached) == len(schedule.hits) == len(schedule.misses) == len(schedule.evicted) == steps
    assert sum(schedule.hits) == round(row["prefix_hit_rate"] * (sum(schedule.hits) + sum(schedule.misses)))
    assert sum(schedule.hits) > 0 and sum(schedule.evicted) == row["blocks_evicted"] > 0
    assert max(schedule.cached) > 0 and all(0 <= u + c <= 1 for u, c in zip(schedule.kv_usage, schedule.cached))
    grid, starts, ends = schedule.cells(axis="time")
    assert ends[-1] == pytest.approx(row["wall_s"], rel=0.05) and all(starts[1:] == ends[:-1])
    binned, _, _ = schedule.cells(max_cols=2)  # a request's prefill and decodes in one bin: the prefill shows
    assert binned.shape == (16, 2) and {int(v) for v in binned.max(axis=1)} == {PREFILL}
    assert (schedule.cells()[0] == DECODE).any()
    for axis in ("step", "time"):
        schedule.draw(str(tmp_path / f"{axis}.png"), axis=axis)
        assert (tmp_path / f"{axis}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="'step' or 'time'"):
        schedule.cells(axis="seconds")


def test_fair_share_keeps_one_tenants_burst_from_holding_the_other_back(tiny_config):
    from jitney.bench.traces import materialize, two_tenants

    work = materialize(two_tenants(120, 4.0, seed=5), 256)
    for a in work:  # the tiny model's context is 512 tokens
        a.prompt, a.output_tokens = a.prompt[:200], min(a.output_tokens, 100)
    rows = {s: simulate(meta_model(str(tiny_config)), work, SHAPED, scheduler=s, block_size=4, num_blocks=400,
                        max_batch_tokens=64) for s in ("fifo", "fair_share")}
    assert {r["refused"] for r in rows.values()} == {0}
    fifo, fair = rows["fifo"]["tenants"], rows["fair_share"]["tenants"]
    assert fair["chat"]["requests"] == fifo["chat"]["requests"] == 12
    assert fair["chat"]["ttft_p50_ms"] < fifo["chat"]["ttft_p50_ms"] / 5  # its requests no longer queue behind
    assert rows["fair_share"]["wall_s"] == pytest.approx(rows["fifo"]["wall_s"], rel=0.1)  # the same work done


async def test_request_metadata_is_what_a_scheduler_sees():
    from jitney.schedulers.fifo import FifoScheduler

    seen = []

    class Looking(FifoScheduler):
        def schedule(self, waiting, active, cache):
            seen.extend(s.request.metadata for s in waiting)
            return super().schedule(waiting, active, cache)

    class Registers:
        @hookimpl
        def jitney_register_schedulers(self, register):
            register("looking", Looking)

    async with Engine(tiny_llama(), config=EngineConfig(num_blocks=16, scheduler="looking"),
                      plugins=[Registers()]) as engine:
        await engine.generate(Request([4, 5], SamplingParams(max_new_tokens=2), metadata={"tenant": "a"}))
    assert seen and seen[0] == {"tenant": "a"}


def test_an_analytic_profile_follows_the_hardware_figures(tiny_config):
    from jitney.bench.profile import analytic

    model = meta_model(str(tiny_config))
    params = sum(p.numel() for p in model.parameters())
    slow, fast = analytic(model, 1.0, 100.0), analytic(model, 2.0, 200.0, step_overhead_s=0.001)
    assert slow.coefficients[0] == pytest.approx(params * 2 / 100e9)  # every weight read once a step
    assert fast.coefficients[0] == pytest.approx(params * 2 / 200e9 + 0.001)
    assert fast.coefficients[1:] == pytest.approx([c / 2 for c in slow.coefficients[1:]])
    work = [Arrival([5, 6, 7, 8], 16) for _ in range(8)]
    rows = [simulate(model, work, p, block_size=4, num_blocks=64) for p in (slow, analytic(model, 2.0, 200.0))]
    assert rows[1]["wall_s"] == pytest.approx(rows[0]["wall_s"] / 2, rel=0.02)  # twice the hardware, half the time


SPECULATING = StepProfile(model="tiny", machine="test", coefficients=[*SHAPED.coefficients, 5e-3, 1e-4, 1e-4],
                          fit_error=0, total_error=0, steps=0, acceptance=0.7)


def test_speculative_steps_are_simulated_where_the_profile_was_calibrated_with_them(tiny_config):
    model = meta_model(str(tiny_config))
    work = [Arrival([5, 6, 7, 8], 40), Arrival([9, 10], 40)]
    assert simulate(model, work, SHAPED, block_size=4, num_blocks=64)["speculative_steps"] == 0  # (not calibrated)
    seen = {p: Timeline() for p in (0.0, 0.7, 1.0)}
    rows = {p: simulate(model, work, msgspec.structs.replace(SPECULATING, acceptance=p), plugins=[seen[p]],
                        block_size=4, num_blocks=64) for p in seen}
    assert all(r["speculative_steps"] > 0 for r in rows.values())
    assert rows[0.0]["draft_accepted_share"] == 0 and rows[1.0]["draft_accepted_share"] == 1
    assert 0 < rows[0.7]["draft_accepted_share"] < 1
    assert rows[1.0]["steps"] < rows[0.7]["steps"] < rows[0.0]["steps"]  # accepted proposals save steps
    assert {t.generated for t in seen.values()} == {80}  # every token, however many steps
    assert simulate(model, work, SPECULATING, block_size=4, num_blocks=64, speculative_tokens=0)["speculative_steps"] == 0
    # a speculative step costs its draft's passes on top of the checking pass
    draft_only = msgspec.structs.replace(SPECULATING, coefficients=[0.0] * 6 + [1.0, 0.0, 0.0], acceptance=0.0)
    row = simulate(model, work, draft_only, block_size=4, num_blocks=64)
    assert row["wall_s"] == pytest.approx(row["draft_tokens"] / 2)  # k passes a step, k drafts for each of 2 rows


def test_calibration_sees_the_speculative_steps_and_drafts_a_real_engine_takes():
    from jitney.bench.profile import SPECULATIVE, StepRecorder
    from jitney.bench.stats import StepStats

    stats = StepStats()
    engine = Engine(tiny_llama(), config=EngineConfig(block_size=4, num_blocks=64), plugins=[stats])
    recorder = StepRecorder(engine.executor)
    serve_all(engine, [Arrival([5, 6, 7, 8], 30), Arrival([9, 10], 30)])
    assert stats.speculative_steps > 0  # (the tiny Llama decodes on the CPU's one-call decoder)
    assert sum(shape[SPECULATIVE] > 0 for shape in recorder.shapes) == stats.speculative_steps
    assert recorder.accepted == stats.accepted > 0
    assert recorder.accepted + recorder.rejected <= stats.drafted  # (proposals after a rejected one: unchecked)


def test_host_overhead_is_measured_for_analytic_profiles(tiny_config):
    from jitney.bench.profile import analytic, host_overhead

    model = meta_model(str(tiny_config))
    step_s, row_s = host_overhead(model)
    assert 0 < step_s < 0.05 and 0 <= row_s < 0.001
    with_host = analytic(model, 1.0, 100.0, step_overhead_s=step_s, row_overhead_s=row_s)
    assert with_host.coefficients[0] == pytest.approx(analytic(model, 1.0, 100.0).coefficients[0] + step_s)


def test_a_fleet_is_simulated_with_the_router_plugins_each_replica_on_its_own_clock(tiny_config):
    model = meta_model(str(tiny_config))
    work = prefixes_workload()
    rows = {r: simulate(model, work, SHAPED, replicas=2, router=r, **CONFIG, plugins=[Registers()])
            for r in ("prefix_affinity", "round_robin")}
    assert rows["round_robin"]["requests_per_replica"] == [24, 24]
    assert sum(rows["prefix_affinity"]["requests_per_replica"]) == 48
    # requests of one prefix kept together hit the cache more than requests dealt out in turn
    assert rows["prefix_affinity"]["prefix_hit_rate"] > rows["round_robin"]["prefix_hit_rate"]
    # two replicas run side by side: two one-at-a-time requests take half as long as on one engine
    pair = [Arrival([5, 6, 7], 8), Arrival([8, 9, 10], 8)]
    one = simulate(model, pair, CONSTANT, block_size=4, num_blocks=16, max_requests_per_batch=1)
    two = simulate(model, pair, CONSTANT, replicas=2, router="round_robin", block_size=4, num_blocks=16,
                   max_requests_per_batch=1)
    assert two["wall_s"] == pytest.approx(one["wall_s"] / 2, rel=0.1)
    with pytest.raises(ValueError, match="unknown router 'nearest'"):
        simulate(model, pair, CONSTANT, replicas=2, router="nearest", block_size=4, num_blocks=16)


def test_a_trace_recorded_without_token_ids_keeps_the_prefix_sharing_and_no_text(tmp_path, tiny_config):
    from jitney.bench.traces import materialize, read_trace
    from jitney.plugins.trace import TraceRecorder

    work = prefixes_workload()[:16]
    path = tmp_path / "private.jsonl"
    real = Timeline()
    serve_all(Engine(tiny_llama(), config=EngineConfig(**CONFIG, speculative_tokens=0, lookup_tokens=0),
                     plugins=[TraceRecorder(path), real, Registers()]), work)
    text = path.read_text()
    assert "prompt_ids" not in text and "prefix_hashes" in text
    replay = materialize(read_trace(path), 256)  # (arrivals are rounded to 0.1 ms: ties come in any order)

    def shared_blocks(a: list[int], b: list[int]) -> int:
        k = 0
        while (k + 1) * 16 <= min(len(a), len(b)) and a[k * 16 : (k + 1) * 16] == b[k * 16 : (k + 1) * 16]:
            k += 1
        return k

    def structure(prompts):  # each prompt's length and the blocks it shares with every prompt, in any order
        return sorted((len(a), sorted(shared_blocks(a, b) for b in prompts)) for a in prompts)

    assert structure([a.prompt for a in replay]) == structure([a.prompt for a in work])
    assert any(0 < n < 2 for _, row in structure([a.prompt for a in work]) for n in row)  # some share a block
    row = simulate(meta_model(str(tiny_config)), replay, SHAPED, plugins=[Registers()], **CONFIG)
    assert row["prefix_hit_rate"] > 0


def test_calibration_refuses_a_noisy_fit_and_keeps_a_better_profile(tiny_config, tmp_path, monkeypatch, capsys):
    """A fit error above 10%, or a profile worse than the one saved: not written (exit 1, the reason and what to do), unless --force; the first simulation on a machine
    refuses to keep a noisy calibration too."""
    from msgspec.structs import replace

    from jitney.bench import profile
    from jitney.cli import main

    assert profile.refusal(SHAPED) is None
    noisy = replace(SHAPED, fit_error=2.319, steps=500)
    assert "fit error (231.9% a step) is above 10%" in profile.refusal(noisy)
    good, fine = replace(SHAPED, fit_error=0.04, steps=500), replace(SHAPED, fit_error=0.06, steps=500)
    assert "already saved fits better (4.0% a step against 6.0%)" in profile.refusal(fine, good)
    assert profile.refusal(good, fine) is None
    assert profile.refusal(replace(fine, calibration=profile.CALIBRATION), replace(good, calibration=1)) is None

    out = tmp_path / "p.json"
    for fitted, code, kept in ((good, 0, good), (noisy, 1, good), (fine, 1, good), (fine, 0, fine)):
        monkeypatch.setattr(profile, "calibrate_model", lambda model, fitted=fitted: fitted)
        force = ["--force"] if fitted is fine and kept is fine else []
        assert main(["calibrate", "--model", "x", "--out", str(out), *force]) == code
        assert load_profile(str(out), "x") == kept
    assert "run `jitney calibrate` again on a quiet machine" in capsys.readouterr().err

    monkeypatch.setenv("JITNEY_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(profile, "calibrate_model", lambda model: noisy)
    assert main(["simulate", "--model", str(tiny_config.parent), "--workload", "mixed-16"]) == 2
    assert "the calibration just run is not kept" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError):
        load_profile(None, str(tiny_config.parent))


def test_a_profile_from_an_earlier_calibration_is_calibrated_again(tiny_config, tmp_path, monkeypatch, capsys):
    from msgspec.structs import replace

    from jitney.bench import profile
    from jitney.cli import main

    monkeypatch.setenv("JITNEY_HOME", str(tmp_path))
    checkpoint = str(tiny_config.parent)
    profile.save_profile(replace(SHAPED, steps=400, calibration=1), profile.profile_path(checkpoint))
    fitted = replace(SHAPED, steps=450, calibration=profile.CALIBRATION)
    monkeypatch.setattr(profile, "calibrate_model", lambda model: fitted)
    assert main(["simulate", "--model", checkpoint, "--workload", "mixed-16"]) == 0
    assert "fitted by an earlier calibration" in capsys.readouterr().err
    assert load_profile(None, checkpoint) == fitted  # (in its place)


def test_the_screens_rests_are_recorded_and_fitted_apart():
    """A step whose greedy rows took every logit while the LM head's screen rested carries `screen_resting`, and the
    fit gives that its own cost, apart from the step's and the rows' (a flat head misses the screen: it rests)."""
    from jitney.bench.profile import FEATURES, StepRecorder, fit_in_two

    config = EngineConfig(block_size=4, num_blocks=128, speculative_tokens=0, lookup_tokens=0)
    engine = Engine(flat_head_llama(), config=config)
    recorder = StepRecorder(engine.executor)
    serve_all(engine, [Arrival([5 + i, 6, 7, 8], 40) for i in range(8)])
    resting = FEATURES.index("screen_resting")
    rests = [shape for shape in recorder.shapes if shape[resting]]
    assert rests and len(rests) < len(recorder.shapes)  # (the first 128 rows through the screen, then rests)
    assert all(shape[FEATURES.index("sampled_rows")] for shape in rests)
    truth = [2e-3, 1e-5, 3e-5, 1e-4, 0, 1e-2, 0, 0, 0, 5e-3]
    seconds = [sum(c * x for c, x in zip(truth, shape)) for shape in recorder.shapes]
    assert fit_in_two(recorder.shapes, seconds)[resting] == pytest.approx(5e-3, rel=0.05)


def test_a_calibration_workload_is_timed_without_prompt_lookup_and_in_a_process_of_its_own():
    """`time_workload`, as `calibrate` runs each workload: plain decode steps (a random model's replies repeat, so
    lookup would have checked guesses, as it did in the calibrations before), the first step left out; and the same
    in a spawned child, which `calibrate` uses so that each workload's engine is the first in its process."""
    from jitney.bench.isolation import run_in_child
    from jitney.bench.profile import FEATURES, time_workload

    work = [([5 + i, 6, 7, 8], 24) for i in range(4)]
    query, sampled = FEATURES.index("query_tokens"), FEATURES.index("sampled_rows")
    for timed in (time_workload(tiny_llama(), None, "tiny", work, 0, {}),
                  run_in_child(time_workload, tiny_llama(), None, "tiny", work, 0, {})[0]):
        shapes, seconds, accepted, rejected = timed
        assert len(shapes) == len(seconds) >= 23 and accepted == rejected == 0
        decodes = [s for s in shapes if s[query] == s[sampled]]
        assert decodes and all(s[query] <= len(work) for s in decodes)  # (one token a row: no guesses checked)

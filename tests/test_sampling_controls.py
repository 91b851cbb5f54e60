"""Penalties, bias, min_p, min_tokens and logprobs: each as its definition says, tokens as `generate` gives them where
transformers has the same control, and rows that need their whole logits kept off the shortcuts."""

from __future__ import annotations

import pytest
import torch
from support import complete_all, random_requests
from test_speculative import Steps
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.core.hooks import hookimpl
from jitney.core.processors import BUILTIN, Row, chain, repetition_penalty, shape
from jitney.core.sampling import sample

def row(params: SamplingParams, prompt, output, stops=frozenset()) -> Row:
    return Row(params, list(prompt), tuple(output), frozenset(stops), chain(params, BUILTIN))


def generate(model, prompt: list[int], n: int, **kw) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, **kw)
    return out[0, len(prompt):].tolist()


def model_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's own fp32 logits at every position of `ids`."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


async def run(model, requests: list[Request], **config):
    async with Engine(model, config=EngineConfig(num_blocks=64, block_size=4, **config)) as engine:
        return await complete_all(engine, requests)


def test_repetition_penalty_is_transformers_bit_for_bit():
    torch.manual_seed(0)
    logits = torch.randn(300) * 4
    prompt, output = [5, 7, 7, 299, 12], (12, 40, 5)
    params = SamplingParams(repetition_penalty=1.3)
    ours = repetition_penalty(logits, row(params, prompt, output))
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([[*prompt, *output]]), logits[None].clone())[0]
    assert torch.equal(ours, theirs)


def test_frequency_and_presence_penalties_are_openais():
    torch.manual_seed(1)
    logits = torch.randn(50)
    output = (3, 3, 3, 9, 17, 9)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.5)
    want = logits.clone()
    for tok in set(output):  # mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence
        want[tok] -= output.count(tok) * 0.5 + 1.5
    got = shape(logits, row(params, [3, 4], output))
    torch.testing.assert_close(got, want)
    assert got[4] == logits[4]  # (the prompt is not penalised)


def test_bias_and_min_tokens_edit_the_row_before_the_penalties():
    logits = torch.zeros(10)
    params = SamplingParams(logit_bias={2: 5.0, 3: -100.0}, min_tokens=2, max_new_tokens=4)
    got = shape(logits, row(params, [1], (4,), {2, 7}))
    assert got[2] == float("-inf") and got[7] == float("-inf") and got[3] == -100.0 and got[0] == 0.0
    assert torch.equal(shape(logits, row(params, [1], (4, 4), {2, 7})), torch.tensor(
        [0.0, 0.0, 5.0, -100.0, 0, 0, 0, 0, 0, 0]))


def test_min_p_of_one_keeps_only_the_likeliest_token():
    torch.manual_seed(2)
    logits = torch.randn(8, 64)
    params = [SamplingParams(temperature=1.5, min_p=1.0)] * 8
    gens = [torch.Generator().manual_seed(i) for i in range(8)]
    tokens, errors, _ = sample(logits, params, gens)
    assert not errors and tokens == logits.argmax(-1).tolist()


async def test_greedy_repetition_penalty_gives_generates_tokens(llama):
    work = random_requests(5, llama.config.vocab_size, max_prompt=30, max_new=20, seed=11)
    reqs = [Request(p, SamplingParams(max_new_tokens=n, ignore_eos=True, repetition_penalty=1.5)) for p, n in work]
    done = await run(llama, reqs)
    for (prompt, n), c in zip(work, done):
        assert c.token_ids == generate(llama, prompt, n, repetition_penalty=1.5)


async def test_logit_bias_and_min_tokens_through_the_engine(llama):
    prompt = [9, 8, 7, 6]
    first = generate(llama, prompt, 1)[0]
    favoured = (first + 1) % llama.config.vocab_size
    biased, held = await run(llama, [
        Request(prompt, SamplingParams(max_new_tokens=5, ignore_eos=True, logit_bias={favoured: 100.0})),
        # the model's first token is a stop token: without min_tokens the request would end on it
        Request(prompt, SamplingParams(max_new_tokens=6, stop_token_ids=(first,), min_tokens=3)),
    ])
    assert biased.token_ids == [favoured] * 5
    assert len(held.token_ids) >= 3 and first not in held.token_ids[:3]
    plain = (await run(llama, [Request(prompt, SamplingParams(max_new_tokens=6, stop_token_ids=(first,)))]))[0]
    assert plain.token_ids == [first] and plain.finish_reason == "stop"


async def test_logprobs_are_the_models_own(llama):
    prompts = [[5, 6, 7], [100, 3, 3, 3, 9, 40]]
    reqs = [Request(prompts[0], SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=3)),
            Request(prompts[1], SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=0, temperature=1.0,
                                               seed=4, presence_penalty=1.0))]
    done = await run(llama, reqs)
    for prompt, c, k in zip(prompts, done, (3, 0)):
        lp = model_logprobs(llama, prompt + c.token_ids)
        assert len(c.samples[0].logprobs) == len(c.token_ids)
        for j, (tok, (logprob, top)) in enumerate(zip(c.token_ids, c.samples[0].logprobs)):
            row = lp[len(prompt) - 1 + j]
            assert logprob == pytest.approx(float(row[tok]), abs=1e-4)
            assert list(top) == row.topk(k).indices.tolist() if k else top == {}
            assert list(top.values()) == pytest.approx(row.topk(k).values.tolist(), abs=1e-4) if k else True
    assert done[0].token_ids == generate(llama, prompts[0], 8)  # (asking for logprobs changes no token)


async def test_streamed_tokens_carry_their_logprobs_with_n_samples(llama):
    async with Engine(llama, config=EngineConfig(num_blocks=64, block_size=4)) as engine:
        params = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=2, n=3, temperature=1.0, seed=1)
        stream = engine.stream(Request([1, 2, 3, 4, 5], params))
        seen: dict[int, list] = {0: [], 1: [], 2: []}
        async for token in stream:
            assert token.logprob is not None and len(token.top_logprobs) == 2
            seen[token.index].append((token.token_id, token.logprob, token.top_logprobs))
        done = stream.completion()
    for s in done.samples:
        assert [t for t, _, _ in seen[s.index]] == s.token_ids
        assert [(lp, top) for _, lp, top in seen[s.index]] == s.logprobs
        lp = model_logprobs(llama, [1, 2, 3, 4, 5] + s.token_ids)
        assert s.logprobs[0][0] == pytest.approx(float(lp[4, s.token_ids[0]]), abs=1e-4)


class Calls:
    """A processor that notes the length of the output each call saw."""

    def __init__(self):
        self.seen: list[int] = []

    @hookimpl
    def jitney_register_logits_processors(self, register):
        def note(logits, row):
            self.seen.append(len(row.output_ids))
            return logits

        register("note", lambda engine: note)


@pytest.mark.parametrize("shortcut", [dict(speculative_tokens=4, lookup_tokens=0),
                                      dict(speculative_tokens=0, lookup_tokens=4)], ids=["draft", "lookup"])
async def test_rows_that_read_their_logits_are_checked_under_their_processors(llama, shortcut):
    """The draft's and prompt lookup's proposals go to rows with logprobs, penalties, a bias or a processor of their
    own too, checked position by position under their processors: tokens, logprobs and every processor call are
    those of decode steps one after another (and `generate`'s where it has the control)."""
    work = [([7, 8, 9, 10, 11] * 4, 24), ([40, 41, 42] * 5, 20),
            *((p, 20) for p, _ in random_requests(3, llama.config.vocab_size, seed=5))]
    controls = [dict(logprobs=2), dict(repetition_penalty=1.2), dict(logit_bias={7: -5.0}, frequency_penalty=0.3),
                dict(processors=("note",), min_tokens=3), {}]
    reqs = [Request(p, SamplingParams(max_new_tokens=n, **c)) for (p, n), c in zip(work, controls)]

    async def complete(**config):
        steps, calls = Steps(), Calls()
        config = EngineConfig(num_blocks=200, block_size=4, **config)
        async with Engine(llama, config=config, plugins=[calls, steps]) as engine:
            return await complete_all(engine, reqs), steps, calls.seen

    plain, _, seen = await complete(speculative_tokens=0, lookup_tokens=0)
    done, steps, seen_speculating = await complete(**shortcut)
    assert any(s.draft_tokens and s.accepted_tokens for s in steps.steps)
    assert seen_speculating == seen == list(range(len(done[3].token_ids)))
    for c, want in zip(done, plain):
        assert c.token_ids == want.token_ids and c.samples[0].logprobs == want.samples[0].logprobs
    assert done[1].token_ids == generate(llama, *work[1], repetition_penalty=1.2)
    assert done[0].samples[0].logprobs is not None and len(done[0].samples[0].logprobs) == len(done[0].token_ids)


@pytest.mark.parametrize("bad, field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(logit_bias={3: 101.0}), "logit_bias"), (dict(min_tokens=80), "min_tokens"), (dict(logprobs=21), "logprobs"),
])
def test_bad_values_are_refused_by_name(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


async def test_a_bias_outside_the_vocabulary_is_refused_at_submit(llama):
    async with Engine(llama, config=EngineConfig(num_blocks=16)) as engine:
        with pytest.raises(ValueError, match="logit_bias"):
            engine.submit(Request([1, 2], SamplingParams(logit_bias={llama.config.vocab_size: 1.0})))


class NoToken:
    """A plugin's logits processor: never the token `row.params.extra_args["ban"]`; `raise` fails on purpose."""

    @hookimpl
    def jitney_register_logits_processors(self, register):
        def ban(logits, row):
            return logits.index_fill(0, torch.tensor([row.params.extra_args["ban"]]), float("-inf"))

        def broken(logits, row):
            raise KeyError("oops")

        register("ban", lambda engine: ban)
        register("broken", lambda engine: broken)


async def test_a_plugins_logits_processor_edits_only_the_rows_that_name_it(llama):
    prompt = [9, 8, 7, 6]
    plain = generate(llama, prompt, 6)
    banned = plain[0]
    async with Engine(llama, config=EngineConfig(num_blocks=64, block_size=4), plugins=[NoToken()]) as engine:
        params = SamplingParams(max_new_tokens=6, ignore_eos=True, processors=("ban",), extra_args={"ban": banned})
        edited, same = await complete_all(engine, [Request(prompt, params), Request(prompt, SamplingParams(max_new_tokens=6))])
        bad = SamplingParams(max_new_tokens=6, processors=("broken",))
        failed, fine = await complete_all(engine, [Request(prompt, bad), Request(prompt, SamplingParams(max_new_tokens=6))])
        for name, words in (("nope", "is not registered"), ("penalties", "runs by itself")):
            with pytest.raises(ValueError, match=f"'{name}' {words}.*ban, broken"):
                engine.submit(Request(prompt, SamplingParams(processors=(name,))))
    assert banned not in edited.token_ids and same.token_ids == plain
    assert failed.finish_reason == "error" and "logits processor 'broken' failed: KeyError" in failed.error
    assert fine.token_ids == plain  # (the batch it was in goes on)

